"""XAttention block-sparse estimate, computable one KV chunk at a time (seed 003).

Tiles: queries and keys are cut into tiles of `stride` (S) positions (the last one zero
padded). The antidiagonal score of query tile i and key tile j is

    score[i, j] = sm_scale / S * sum_s q[i*S + S-1-s] . k[j*S + s]

(the antidiagonal of the S x S block of QK^T). Key tile j is visible to query tile i iff
j*S < kv_len and, when causal, k_offset + j*S <= q_offset + i*S (positions of the tiles'
first tokens). Invisible scores are -inf; keys >= kv_len inside a visible tile count as zero.

Rows are softmaxed over all visible key tiles and summed into blocks of r = block_size / S
tiles, giving block_sums [B, Hq, q_blocks, k_blocks]; every query block then keeps the fewest
key blocks whose mass reaches `threshold` (the first block and the diagonal always kept).

KV-chunked pipeline (the keys never need to be resident at once):
  1. per chunk c: scores_c, m_c, l_c = antidiagonal_scores(q, k_c, k_offset=c0, ...)
     (Pallas kernel; (m_c, l_c) are the chunk's softmax_partial_stats, fused in)
  2. m, l = merge_softmax_stats(stack(m_c), stack(l_c))
  3. per chunk: sums_c = softmax_normalize_block_sum(scores_c, m, l, ...)
     (Pallas kernel that reads only visible tiles)
  4. mask = select_blocks(concat(sums_c, axis=-1), ...)
Chunk boundaries must be multiples of block_size so that chunk blocks line up with the
global ones. `xattn_estimate` runs the pipeline (impl="pallas") or a one-shot jnp reference
over the whole key (impl="xla").

Steps 2 and 4 are jnp: they touch only per-row stats and the block sums (1/block_size^2 of
the attention matrix), so a kernel would not save measurable time (select_blocks: 0.12 ms at
32K tokens and 32 heads on an H200).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    NEG_INF,
    cdiv,
    check_attention_shapes,
    check_sm_scale,
    compiler_params,
    dot_precision,
    fdiv,
    fit_block,
    interpret_aware_jit,
    next_pow2,
    per_batch,
    resolve_interpret,
)


# Key tiles one program of the score kernel covers (a power of two, so a multiple of every block_n; 64K keys at
# stride 8: shorter prompts run one program per query block and head, as before). Programs split a long key range so
# that the few query tiles of a chunk after a 1M-token prefix still fill the GPU: one program per query block and head
# ran 32 programs, 267 ms an 8B layer on an H200 (bench/results/runs/h200_xattn_chunk/).
KEY_SPLIT_TILES = 8192


def default_xattn_config(dtype) -> dict[str, int]:
    """Score-kernel tiles (in key/query tiles, not tokens), tuned on an H200."""
    if jnp.dtype(dtype) == jnp.float32:
        return dict(block_m=32, block_n=32, num_warps=4, num_stages=2)
    return dict(block_m=128, block_n=128, num_warps=8, num_stages=3)


def _check_stride(stride: int, block_size: int | None = None) -> None:
    if stride < 1:
        raise ValueError(f"stride={stride}; allowed: >= 1")
    if block_size is not None and (block_size < stride or block_size % stride):
        raise ValueError(
            f"block_size={block_size} is not a multiple of stride={stride}; allowed: "
            "block_size = r * stride with r >= 1")


def _tile(x: jax.Array, stride: int) -> jax.Array:
    """[B, T, H, D] -> [B, ceil(T/S), S, H, D], zero padding the last tile."""
    b, t, h, d = x.shape
    n = -(-t // stride)
    if n * stride != t:
        x = jnp.pad(x, ((0, 0), (0, n * stride - t), (0, 0), (0, 0)))
    return x.reshape(b, n, stride, h, d)


def _visible_key_tiles(q_offset, k_offset, kv_len, r0, block_m: int, mq: int, stride: int,
                       causal: bool):
    """(kv_tiles, hi): key tiles < kv_tiles hold a valid key; tiles >= hi are hidden from every
    query tile row in [r0, r0 + block_m)."""
    kv_tiles = cdiv(kv_len, stride)
    if not causal:
        return kv_tiles, kv_tiles
    last = q_offset + (jnp.minimum(r0 + block_m, mq) - 1) * stride - k_offset
    hi = jnp.where(last >= 0, fdiv(jnp.maximum(last, 0), stride) + 1, 0)
    return kv_tiles, jnp.minimum(hi, kv_tiles)


def _tile_visibility(q_offset, k_offset, kv_tiles, rows, cols, stride: int, causal: bool):
    vis = (cols < kv_tiles)[None, :]
    if causal:
        vis = vis & ((k_offset + cols * stride)[None, :] <= (q_offset + rows * stride)[:, None])
    return vis


def _scores_kernel(qoff_ref, koff_ref, kvlen_ref, q_ref, k_ref, s_ref, m_ref, l_ref, *,
                   stride: int, scale: float, causal: bool, fill_hidden: bool, block_m: int,
                   block_n: int, mq: int, mk: int, split_blocks: int, precision):
    r0 = pl.multiple_of(pl.program_id(0) * block_m, block_m)
    rows = r0 + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = rows < mq
    q_offset, k_offset, kv_len = qoff_ref[()], koff_ref[()], kvlen_ref[()]
    kv_tiles, hi = _visible_key_tiles(q_offset, k_offset, kv_len, r0, block_m, mq, stride,
                                      causal)
    first = pl.program_id(2) * split_blocks  # this program's key blocks: [first, end_all)
    end_all = jnp.minimum(-(-mk // block_n), first + split_blocks)
    end_visible = jnp.clip(cdiv(hi, block_n), first, end_all)

    def visible_block(j, carry):
        m_i, l_i = carry
        c0 = pl.multiple_of(j * block_n, block_n)
        cols = c0 + jnp.arange(block_n, dtype=jnp.int32)
        col_ok = cols < mk

        # A loop (not an unrolled Python for) so Triton software-pipelines these two loads
        # with a few stages instead of staging all 2 * stride tiles in shared memory.
        def diagonal(s, acc):
            qs = plgpu.load(q_ref.at[pl.ds(r0, block_m), stride - 1 - s, :],
                            mask=row_ok[:, None], other=0)
            # Keys past kv_len read as zero (this also keeps loads inside the array).
            key_ok = (cols * stride + s) < kv_len
            ks = plgpu.load(k_ref.at[pl.ds(c0, block_n), s, :], mask=key_ok[:, None], other=0)
            return acc + plgpu.dot(qs, ks, trans_b=True, precision=precision)

        acc = lax.fori_loop(0, stride, diagonal, jnp.zeros((block_m, block_n), jnp.float32))
        vis = _tile_visibility(q_offset, k_offset, kv_tiles, rows, cols, stride, causal)
        sc = jnp.where(vis, acc * scale, NEG_INF)
        plgpu.store(s_ref.at[pl.ds(r0, block_m), pl.ds(c0, block_n)], sc,
                    mask=row_ok[:, None] & col_ok[None, :])
        m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        l_i = l_i * jnp.exp(m_i - m_use) + jnp.sum(jnp.exp(sc - m_use[:, None]), axis=1)
        return m_new, l_i

    def hidden_block(j, carry):
        c0 = pl.multiple_of(j * block_n, block_n)
        col_ok = (c0 + jnp.arange(block_n, dtype=jnp.int32)) < mk
        plgpu.store(s_ref.at[pl.ds(r0, block_m), pl.ds(c0, block_n)],
                    jnp.full((block_m, block_n), NEG_INF, jnp.float32),
                    mask=row_ok[:, None] & col_ok[None, :])
        return carry

    carry = (jnp.full((block_m,), NEG_INF, jnp.float32), jnp.zeros((block_m,), jnp.float32))
    m_i, l_i = lax.fori_loop(first, end_visible, visible_block, carry)
    if fill_hidden:
        lax.fori_loop(end_visible, end_all, hidden_block, 0)
    plgpu.store(m_ref.at[pl.ds(r0, block_m)], m_i, mask=row_ok)
    plgpu.store(l_ref.at[pl.ds(r0, block_m)], l_i, mask=row_ok)


def _antidiagonal_scores(q, k, q_offset, k_offset, kv_len, *, stride, causal, sm_scale,
                         fill_hidden, interpret, block_m, block_n, key_split, num_warps, num_stages):
    batch, _, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    qt, kt = _tile(q, stride), _tile(k, stride)
    mq, mk = qt.shape[1], kt.shape[1]
    split_blocks = key_split // block_n
    num_splits = -(-mk // key_split)
    kernel = functools.partial(
        _scores_kernel, stride=stride, scale=sm_scale / stride, causal=causal,
        fill_hidden=fill_hidden, block_m=block_m, block_n=block_n, mq=mq, mk=mk,
        split_blocks=split_blocks, precision=dot_precision(q.dtype))
    scalar = pl.BlockSpec((None,), lambda i, bh, c: (bh // hq,))
    row_spec = pl.BlockSpec((None, None, None, mq), lambda i, bh, c: (bh // hq, bh % hq, c, 0))
    scores, m, l = pl.pallas_call(
        kernel,
        grid=(-(-mq // block_m), batch * hq, num_splits),
        in_specs=[
            scalar, scalar, scalar,
            pl.BlockSpec((None, mq, stride, None, d), lambda i, bh, c: (bh // hq, 0, 0, bh % hq, 0)),
            pl.BlockSpec((None, mk, stride, None, d),
                         lambda i, bh, c: (bh // hq, 0, 0, (bh % hq) // group, 0)),
        ],
        out_specs=[pl.BlockSpec((None, None, mq, mk), lambda i, bh, c: (bh // hq, bh % hq, 0, 0)),
                   row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, hq, mq, mk), jnp.float32),
                   jax.ShapeDtypeStruct((batch, hq, num_splits, mq), jnp.float32),
                   jax.ShapeDtypeStruct((batch, hq, num_splits, mq), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="xattn_antidiagonal_scores",
    )(q_offset, k_offset, kv_len, qt, kt)
    # Splits fold one after another, in a loop (one compiled body, whatever the count): a split a row cannot see adds
    # (-inf, 0), which changes no bit, so a row's stats do not depend on how many keys past it the call holds.
    def fold(c, carry):
        m_all, l_all = carry
        m_c, l_c = m[:, :, c], l[:, :, c]
        m_new = jnp.maximum(m_all, m_c)
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        return m_new, l_all * jnp.exp(m_all - m_use) + l_c * jnp.exp(m_c - m_use)

    m_all, l_all = lax.fori_loop(1, num_splits, fold, (m[:, :, 0], l[:, :, 0]))
    return scores, m_all, l_all


_antidiagonal_scores_jit = interpret_aware_jit(
    _antidiagonal_scores, ("stride", "causal", "sm_scale", "fill_hidden", "interpret",
                           "block_m", "block_n", "key_split", "num_warps", "num_stages"))


def antidiagonal_scores(q: jax.Array, k: jax.Array, *, stride: int, causal: bool = True,
                        q_offset=0, k_offset=0, kv_len=None, sm_scale: float | None = None,
                        fill_hidden: bool = True, interpret: bool | None = None,
                        block_m: int | None = None,
                        block_n: int | None = None, key_split: int = KEY_SPLIT_TILES,
                        num_warps: int | None = None,
                        num_stages: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Strided antidiagonal scores of a query chunk against one key chunk (Pallas kernel).

    Args:
      q: [B, Tq, Hq, D]; k: [B, Tk, Hkv, D] (a key chunk), Hq % Hkv == 0.
      stride: tile size S (static).
      causal, q_offset, k_offset: absolute positions of q[0] and k[0]; tile j of this chunk is
        hidden from query tile i when k_offset + j*S > q_offset + i*S. Ints or int32 arrays
        (scalar or [B]); may be traced.
      kv_len: valid keys in this chunk (keys >= kv_len are hidden); None means Tk.
      sm_scale: default 1/sqrt(D) (> 0); scores are multiplied by sm_scale / S.
      fill_hidden: write -inf into key blocks hidden from a whole program (block_m rows x
        block_n tiles). False leaves them unwritten (garbage), which saves memory traffic
        when the consumer is `softmax_normalize_block_sum`, which never reads them.
      block_m, block_n: tiles per program along queries/keys (powers of two >= 16).
      key_split: key tiles per program (a multiple of block_n); a row's stats are the same
        bits however many keys past its last visible one the call holds.

    Returns:
      scores [B, Hq, ceil(Tq/S), ceil(Tk/S)] float32 (-inf where hidden) and this chunk's
      softmax_partial_stats m, l [B, Hq, ceil(Tq/S)] (row max and sum of exp(score - m);
      m = -inf, l = 0 for a row that sees nothing). Hidden key blocks cost no dot products.
    """
    batch, tq, hq, tk, hkv, d = check_attention_shapes(q, k, k, 4)
    _check_stride(stride)
    cfg = default_xattn_config(q.dtype)
    mq, mk = -(-tq // stride), -(-tk // stride)
    block_n = fit_block(block_n or cfg["block_n"], mk)
    if key_split < block_n or key_split % block_n:
        raise ValueError(f"key_split={key_split}; allowed: a multiple of block_n={block_n}")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    return _antidiagonal_scores_jit(
        q, k, per_batch(q_offset, batch, "q_offset"), per_batch(k_offset, batch, "k_offset"),
        kv_len, stride=int(stride), causal=bool(causal), sm_scale=check_sm_scale(sm_scale, d),
        fill_hidden=bool(fill_hidden), interpret=resolve_interpret(interpret),
        block_m=fit_block(block_m or cfg["block_m"], mq),
        block_n=block_n, key_split=int(key_split),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])


@jax.jit
def softmax_partial_stats(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row max m and sum l = sum(exp(scores - m)) over the last axis (one key chunk).

    -inf scores are hidden; a row with no finite score gives m = -inf, l = 0. This is what
    `antidiagonal_scores` already returns fused; use it for scores produced elsewhere.
    """
    m = jnp.max(scores, axis=-1)
    m_use = jnp.where(m == NEG_INF, 0.0, m)
    return m, jnp.sum(jnp.exp(scores - m_use[..., None]), axis=-1)


def merge_softmax_stats(m_chunks: jax.Array | Sequence[jax.Array],
                        l_chunks: jax.Array | Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Merge per-chunk row stats: m = max_c m_c, l = sum_c l_c exp(m_c - m).

    Takes stacked arrays [N, ...] or sequences of N arrays; all-empty rows stay (-inf, 0).
    """
    def stacked(x):
        return x if isinstance(x, jax.Array) else jnp.stack(list(x))

    return _merge_softmax_stats(stacked(m_chunks), stacked(l_chunks))


@jax.jit
def _merge_softmax_stats(m_stack, l_stack):
    m = jnp.max(m_stack, axis=0)
    m_use = jnp.where(m == NEG_INF, 0.0, m)
    return m, jnp.sum(l_stack * jnp.exp(m_stack - m_use), axis=0)


@functools.partial(jax.jit, static_argnames=("block_size", "stride"))
def _normalize_block_sum_xla(scores, m, l, *, block_size: int, stride: int):
    """jnp normalise + block sum of -inf-filled scores (reference path and fallback)."""
    r = block_size // stride
    b, h, mq, mk = scores.shape
    nqb, nkb = -(-mq // r), -(-mk // r)
    seen = l > 0.0
    m_use = jnp.where(m == NEG_INF, 0.0, m)
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    p = jnp.exp(scores - m_use[..., None]) * inv_l[..., None]
    p = jnp.pad(p, ((0, 0), (0, 0), (0, nqb * r - mq), (0, nkb * r - mk)))
    return p.reshape(b, h, nqb, r, nkb, r).sum(axis=(3, 5))


def _block_sum_kernel(qoff_ref, koff_ref, kvlen_ref, s_ref, m_ref, l_ref, o_ref, *, stride: int,
                      r: int, causal: bool, block_n: int, mq: int, mk: int, nkb: int):
    # One query block (r tile rows) per program, so the row sum is a plain reduction.
    qb = pl.program_id(0)
    r0 = pl.multiple_of(qb * r, r)
    rows = r0 + jnp.arange(r, dtype=jnp.int32)
    row_ok = rows < mq
    q_offset, k_offset = qoff_ref[()], koff_ref[()]
    kv_tiles, hi = _visible_key_tiles(q_offset, k_offset, kvlen_ref[()], r0, r, mq, stride,
                                      causal)
    n_visible = cdiv(hi, block_n)
    n_all = -(-mk // block_n)
    m = plgpu.load(m_ref.at[pl.ds(r0, r)], mask=row_ok, other=0.0)
    l = plgpu.load(l_ref.at[pl.ds(r0, r)], mask=row_ok, other=0.0)
    m = jnp.where(m == NEG_INF, 0.0, m)
    inv_l = jnp.where(l > 0.0, 1.0 / jnp.where(l > 0.0, l, 1.0), 0.0)
    bk = block_n // r
    # in_block[b, c]: tile column c of a block_n-wide slab belongs to key block b of the slab.
    in_block = (jnp.arange(block_n, dtype=jnp.int32)[None, :] // r
                == jnp.arange(bk, dtype=jnp.int32)[:, None])

    def store(c0, sums):
        kb_ok = (c0 // r + jnp.arange(bk, dtype=jnp.int32)) < nkb
        plgpu.store(o_ref.at[qb, pl.ds(c0 // r, bk)], sums, mask=kb_ok)

    def visible_block(j, carry):
        c0 = pl.multiple_of(j * block_n, block_n)
        cols = c0 + jnp.arange(block_n, dtype=jnp.int32)
        tile_ok = row_ok[:, None] & (cols < mk)[None, :]
        sc = plgpu.load(s_ref.at[pl.ds(r0, r), pl.ds(c0, block_n)], mask=tile_ok,
                        other=NEG_INF)
        vis = tile_ok & _tile_visibility(q_offset, k_offset, kv_tiles, rows, cols, stride,
                                         causal)
        p = jnp.where(vis, jnp.exp(sc - m[:, None]) * inv_l[:, None], 0.0)
        col_sums = jnp.sum(p, axis=0)
        store(c0, jnp.sum(jnp.where(in_block, col_sums[None, :], 0.0), axis=1))
        return carry

    def hidden_block(j, carry):
        store(pl.multiple_of(j * block_n, block_n), jnp.zeros((bk,), jnp.float32))
        return carry

    lax.fori_loop(0, n_visible, visible_block, 0)
    lax.fori_loop(n_visible, n_all, hidden_block, 0)


def _block_sum_kernel_fits(r: int) -> bool:
    """The kernel holds one query block of r tile rows: r must be a power of two <= 256."""
    return r & (r - 1) == 0 and r <= 256


def _normalize_block_sum_pallas(scores, m, l, q_offset, k_offset, kv_len, *, stride, r, causal,
                                interpret, block_n, num_warps, num_stages):
    batch, hq, mq, mk = scores.shape
    nqb, nkb = -(-mq // r), -(-mk // r)
    kernel = functools.partial(_block_sum_kernel, stride=stride, r=r, causal=causal,
                               block_n=block_n, mq=mq, mk=mk, nkb=nkb)
    scalar = pl.BlockSpec((None,), lambda i, bh: (bh // hq,))
    row_spec = pl.BlockSpec((None, None, mq), lambda i, bh: (bh // hq, bh % hq, 0))
    return pl.pallas_call(
        kernel,
        grid=(nqb, batch * hq),
        in_specs=[scalar, scalar, scalar,
                  pl.BlockSpec((None, None, mq, mk), lambda i, bh: (bh // hq, bh % hq, 0, 0)),
                  row_spec, row_spec],
        out_specs=pl.BlockSpec((None, None, nqb, nkb), lambda i, bh: (bh // hq, bh % hq, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, hq, nqb, nkb), jnp.float32),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="xattn_normalize_block_sum",
    )(q_offset, k_offset, kv_len, scores, m, l)


_normalize_block_sum_jit = interpret_aware_jit(
    _normalize_block_sum_pallas, ("stride", "r", "causal", "interpret", "block_n", "num_warps",
                                  "num_stages"))


def softmax_normalize_block_sum(scores: jax.Array, m: jax.Array, l: jax.Array, *,
                                block_size: int, stride: int, causal: bool = True, q_offset=0,
                                k_offset=0, kv_len=None, interpret: bool | None = None,
                                block_n: int = 256, num_warps: int = 4,
                                num_stages: int = 3) -> jax.Array:
    """Normalise one key chunk's scores with the global row stats and sum them into blocks.

    Args:
      scores: [B, H, Mq, Mk] tile scores of one key chunk from `antidiagonal_scores`.
      m, l: [B, H, Mq] global stats from `merge_softmax_stats` (or the chunk's own).
      block_size, stride: a block covers r = block_size / stride tiles per side.
      causal, q_offset, k_offset, kv_len: the same visibility arguments that produced the
        scores (kv_len: valid keys of this chunk, None = Mk * stride). Only visible tiles are
        read, so hidden tiles may hold anything (e.g. `fill_hidden=False` garbage).
      block_n: score tiles per inner step (power of two, raised to r when smaller). Each
        program handles one query block (r tile rows).

    Returns:
      [B, H, ceil(Mq/r), ceil(Mk/r)] float32 block sums of the softmax probabilities.
      When r is not a power of two or exceeds 256 this runs as jnp on -inf-filled scores.
    """
    _check_stride(stride, block_size)
    r = block_size // stride
    batch, _, mq, mk = scores.shape
    if not _block_sum_kernel_fits(r):
        return _normalize_block_sum_xla(scores, m, l, block_size=block_size, stride=stride)
    kv_len = jnp.clip(per_batch(mk * stride if kv_len is None else kv_len, batch, "kv_len"),
                      0, mk * stride)
    return _normalize_block_sum_jit(
        scores, m, l, per_batch(q_offset, batch, "q_offset"),
        per_batch(k_offset, batch, "k_offset"), kv_len, stride=int(stride), r=r,
        causal=bool(causal), interpret=resolve_interpret(interpret),
        block_n=max(fit_block(block_n, mk), next_pow2(r)), num_warps=num_warps,
        num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("block_size",))
def select_blocks(block_sums: jax.Array, *, threshold, block_size: int,
                  q_offset=0) -> jax.Array:
    """Per query block keep the fewest key blocks whose cumulative mass reaches threshold.

    Args:
      block_sums: [B, H, nqb, nkb] (key block 0 starts at absolute position 0).
      threshold: tau in (0, 1]; a float or an array broadcastable to [B, H, nqb, 1]
        (e.g. per head). May be traced.
      block_size: tokens per block (static).
      q_offset: absolute position of the first query (int or [B], may be traced); query
        block i's diagonal key block is (q_offset + i * block_size) // block_size.

    Returns:
      bool [B, H, nqb, nkb]. Key block 0 and the diagonal block are always kept and counted
      first; the others are taken in descending mass while the mass taken so far is below
      threshold * row total. Blocks with zero mass (hidden) are never taken.
    """
    b, h, nqb, nkb = block_sums.shape
    sums = block_sums.astype(jnp.float32)
    q_offset = per_batch(q_offset, b, "q_offset")
    kb = jnp.arange(nkb, dtype=jnp.int32)
    diag = (q_offset[:, None] + jnp.arange(nqb, dtype=jnp.int32)[None, :] * block_size)
    diag = jnp.floor_divide(diag, block_size)[:, None, :, None]  # [B, 1, nqb, 1]
    forced = (kb == 0) | (kb == diag)
    need = jnp.asarray(threshold, jnp.float32) * jnp.sum(sums, axis=-1, keepdims=True)
    taken = jnp.sum(jnp.where(forced, sums, 0.0), axis=-1, keepdims=True)
    candidate = jnp.where(forced | (sums <= 0.0), -1.0, sums)
    return forced | _kept_by_sort(candidate, taken, need)


def _kept_by_sort(candidate, taken, need):
    """Candidates (> 0) taken in descending order while taken + mass before them < need."""
    order = jnp.argsort(-candidate, axis=-1, stable=True)
    ranked = jnp.take_along_axis(candidate, order, axis=-1)
    mass = jnp.maximum(ranked, 0.0)
    before = taken + jnp.cumsum(mass, axis=-1) - mass
    keep_ranked = (before < need) & (ranked > 0.0)
    return jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)


@functools.partial(jax.jit, static_argnames=("stride", "causal", "sm_scale"))
def _scores_xla(q, k, q_offset, kv_len, *, stride, causal, sm_scale):
    """One-shot jnp antidiagonal scores over the whole key (the reference path)."""
    batch, _, hq, d = q.shape
    hkv = k.shape[2]
    qt = _tile(q.astype(jnp.float32), stride)[:, :, ::-1]
    key_ok = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < kv_len[:, None]
    kt = _tile(jnp.where(key_ok[:, :, None, None], k.astype(jnp.float32), 0.0), stride)
    mq, mk = qt.shape[1], kt.shape[1]
    qt = qt.reshape(batch, mq, stride, hkv, hq // hkv, d)
    s = jnp.einsum("bisngd,bjsnd->bngij", qt, kt, precision=lax.Precision.HIGHEST)
    s = s.reshape(batch, hq, mq, mk) * (sm_scale / stride)
    q_pos = q_offset[:, None] + jnp.arange(mq, dtype=jnp.int32)[None, :] * stride  # [B, Mq]
    k_pos = jnp.arange(mk, dtype=jnp.int32) * stride
    vis = (k_pos[None, None, :] < kv_len[:, None, None])
    if causal:
        vis = vis & (k_pos[None, None, :] <= q_pos[:, :, None])
    return jnp.where(vis[:, None], s, NEG_INF)


def _estimate(q, k, q_offset, kv_len, threshold, *, block_size, stride, causal, sm_scale,
              kv_chunk, impl, interpret):
    tk = k.shape[1]
    if impl == "xla":
        scores = _scores_xla(q, k, q_offset, kv_len, stride=stride, causal=causal,
                             sm_scale=sm_scale)
        m, l = softmax_partial_stats(scores)
        sums = _normalize_block_sum_xla(scores, m, l, block_size=block_size, stride=stride)
    else:
        starts = range(0, tk, kv_chunk)
        # The block-sum kernel never reads hidden tiles; its jnp fallback needs them -inf.
        fill_hidden = not _block_sum_kernel_fits(block_size // stride)
        parts = [antidiagonal_scores(
            q, k[:, c0:c0 + kv_chunk], stride=stride, causal=causal, q_offset=q_offset,
            k_offset=c0, kv_len=kv_len - c0, sm_scale=sm_scale, fill_hidden=fill_hidden,
            interpret=interpret) for c0 in starts]
        m, l = merge_softmax_stats([p[1] for p in parts], [p[2] for p in parts])
        sums = jnp.concatenate(
            [softmax_normalize_block_sum(
                p[0], m, l, block_size=block_size, stride=stride, causal=causal,
                q_offset=q_offset, k_offset=c0, kv_len=kv_len - c0, interpret=interpret)
             for c0, p in zip(starts, parts)], axis=-1)
    return sums, select_blocks(sums, threshold=threshold, block_size=block_size,
                               q_offset=q_offset)


# One program for the whole pipeline: a single (interpret-mode: fast) compile per config.
_estimate_jit = interpret_aware_jit(
    _estimate, ("block_size", "stride", "causal", "sm_scale", "kv_chunk", "impl", "interpret"))


def xattn_estimate(q: jax.Array, k: jax.Array, *, block_size: int = 128, stride: int = 8,
                   threshold=0.9, causal: bool = True, q_offset=0, kv_len=None,
                   sm_scale: float | None = None, kv_chunk: int | None = None,
                   impl: str = "pallas",
                   interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """XAttention estimate of q [B, Tq, Hq, D] against the whole key k [B, Tk, Hkv, D].

    impl="xla": one-shot jnp reference (scores of the whole key, softmax, block sums).
    impl="pallas": the KV-chunked pipeline of this module with chunks of `kv_chunk` keys
    (None: one chunk); kv_chunk must be a multiple of block_size.
    Keys start at absolute position 0; q_offset is the position of q[0] (int or [B], may be
    traced); kv_len hides keys >= kv_len; threshold may be traced. Returns (block_sums
    [B, Hq, nqb, nkb] float32, mask bool [B, Hq, nqb, nkb]) with nqb = ceil(Tq / block_size),
    nkb = ceil(Tk / block_size).
    """
    batch, tq, hq, tk, hkv, d = check_attention_shapes(q, k, k, 4)
    _check_stride(stride, block_size)
    if impl not in ("pallas", "xla"):
        raise ValueError(f"impl={impl!r}; allowed: 'pallas' or 'xla'")
    chunk = tk if kv_chunk is None else int(kv_chunk)
    if chunk < tk and (chunk <= 0 or chunk % block_size):
        raise ValueError(f"kv_chunk={kv_chunk}; allowed: None or a positive multiple of "
                         f"block_size={block_size}")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    return _estimate_jit(
        q, k, per_batch(q_offset, batch, "q_offset"), kv_len,
        jnp.asarray(threshold, jnp.float32), block_size=int(block_size), stride=int(stride),
        causal=bool(causal), sm_scale=check_sm_scale(sm_scale, d), kv_chunk=min(chunk, tk),
        impl=impl, interpret=resolve_interpret(interpret))
