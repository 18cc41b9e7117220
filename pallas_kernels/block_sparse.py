"""Block-sparse prefill attention with LSE: each query block attends only the key blocks listed
for it (the XAttention prefill, after `xattn.select_blocks` chose the blocks).

`block_sparse_attention_with_lse` is a Pallas kernel (Triton on NVIDIA GPUs, interpreted
elsewhere); `block_sparse_attention_with_lse_xla` is a plain jnp version with the same signature
and semantics, used where interpret mode is too slow (whole models on the CPU).

Semantics shared by both:
  q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]; query head h reads KV head h // (Hq // Hkv).
  Query block i is query rows [i * bs, (i + 1) * bs) (bs = block_size); key block j is keys
  [j * bs, (j + 1) * bs). Query block i of head h visits the key blocks
  kv_blocks[b, h, i, :kv_block_counts[b, h, i]] (ascending, distinct); the other entries are
  padding and never read. Inside a visited block, key j is visible to query row r iff
  j < kv_len and (not causal or j <= q_offset + r), as in `attention_with_lse`.
  o [B, Tq, Hq, D] in out_dtype (default q.dtype); lse [B, Hq, Tq] float32, natural log.
  A row that sees no key gets lse = -inf and o = 0.

With every causally visible block listed, the Pallas kernel gives the bits of `attention_with_lse`
with block_q = block_size and the same block_k: it visits the same key tiles in the same order
with the same arithmetic, only skipping the tiles that are not listed.

On a Hopper GPU, bf16/f16 calls with D 64 or 128 and block_size 128 go to the Mosaic GPU kernel
(`mgpu_block_sparse`, TMA and wgmma) under the dense route's conditions (`runs_on_hopper_kernel`):
no Triton launch parameters given and JAX_OFFLOAD_HOPPER_ATTENTION not "0".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mgpu_block_sparse
from pallas_kernels._common import (
    LOG2E,
    check_block_lists,
    MIN_BLOCK,
    NEG_INF,
    cdiv,
    check_attention_shapes,
    check_out_dtype,
    check_pallas_head_dim,
    check_sm_scale,
    compiler_params,
    dot_precision,
    empty_softmax_state,
    fdiv,
    finish_online_softmax,
    fit_block,
    interpret_aware_jit,
    load_rows,
    online_softmax_update,
    per_batch,
    resolve_interpret,
)
from pallas_kernels.attention import default_attention_config, runs_on_hopper_kernel
from pallas_kernels.state import AttentionState, finish_state


def mask_to_block_lists(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """bool block mask [B, H, nqb, nkb] -> (kv_blocks int32 [B, H, nqb, nkb], counts [B, H, nqb]).

    Row (b, h, i) of kv_blocks starts with the indices of its True blocks in ascending order;
    the entries past counts[b, h, i] are padding (the unlisted blocks, also ascending). Works
    under jit (a stable sort along the last axis).
    """
    mask = jnp.asarray(mask)
    if mask.ndim != 4 or mask.shape[-1] == 0:
        raise ValueError(f"mask has shape {mask.shape}; allowed: [B, H, nqb, nkb] with nkb >= 1")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask has dtype {mask.dtype}; allowed: bool")
    # A stable sort on "not listed" puts the listed blocks first, each group in index order.
    kv_blocks = jnp.argsort(~mask, axis=-1, stable=True).astype(jnp.int32)
    return kv_blocks, jnp.sum(mask, axis=-1, dtype=jnp.int32)


def _check_block_args(q, k, v, kv_blocks, kv_block_counts, block_size, q_offset, kv_len):
    """Validate the arguments; returns (head_dim, int32 kv_blocks, int32 counts clamped to
    [0, max_blocks], int32 q_offset [B], int32 kv_len [B] clamped to [0, Tk])."""
    batch, tq, hq, tk, _, d = check_attention_shapes(q, k, v, 4)
    if block_size < MIN_BLOCK or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}; allowed: a power of two >= {MIN_BLOCK}")
    kv_blocks, counts = check_block_lists(kv_blocks, kv_block_counts, batch, hq, -(-tq // block_size))
    q_offset = per_batch(q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    return d, kv_blocks, counts, q_offset, kv_len


def _key_ranges(q_offset, kv_len, *, tq: int, block_size: int, causal: bool):
    """Per batch and query block [B, nqb]: keys [0, full) are visible to every row of the block,
    keys [0, hi) to some row (the dense kernel's bounds, with block_q = block_size)."""
    nqb = -(-tq // block_size)
    row0 = jnp.arange(nqb, dtype=jnp.int32) * block_size
    last_row = jnp.minimum(row0 + block_size, tq) - 1
    kv = kv_len[:, None]
    if not causal:
        kv = jnp.broadcast_to(kv, (kv_len.shape[0], nqb))
        return kv, kv
    qo = q_offset[:, None]
    return jnp.clip(qo + row0 + 1, 0, kv), jnp.clip(qo + last_row + 1, 0, kv)


def _tile_bounds(kv_blocks, counts, full, hi, *, block_size: int, block_k: int):
    """-> (n_unmasked, n_visible) int32 [B, Hq, nqb]: how many key tiles of the flattened tile list
    of each program need no mask, and how many any row of the block can see.

    The flattened list takes the listed blocks in order and each block's r = block_size / block_k
    tiles in order; tile t of block j is the dense kernel's key tile g = j * r + t. The dense
    kernel runs tiles g < n_full unmasked and n_full <= g < n_blocks masked; with ascending
    blocks both sets are prefixes of the flattened list, so two counts describe them.
    """
    r = block_size // block_k
    live = jnp.arange(kv_blocks.shape[-1], dtype=jnp.int32) < counts[..., None]
    n_blocks = cdiv(hi, block_k)
    n_full = jnp.minimum(fdiv(full, block_k), n_blocks)
    first_tile = kv_blocks * r  # garbage padding may overflow; it is masked by `live`

    def tiles_below(n):  # [B, nqb] -> per program, the listed tiles with g < n
        per_block = jnp.clip(n[:, None, :, None] - first_tile, 0, r)
        return jnp.sum(jnp.where(live, per_block, 0), axis=-1, dtype=jnp.int32)

    return tiles_below(n_full), tiles_below(n_blocks)


def _block_sparse_kernel(qoff_ref, kvlen_ref, kvb_ref, nunm_ref, nvis_ref, q_ref, k_ref, v_ref,
                         o_ref, lse_ref, *, causal: bool, scale_log2: float, block_size: int,
                         block_q: int, block_k: int, tq: int, num_q_blocks: int, precision):
    pid = pl.program_id(0)
    # Causal: the last query blocks usually list the most key blocks, so launch them first.
    i = (num_q_blocks - 1 - pid) if causal else pid
    # block_q < block_size only when the single query block is shorter than block_size.
    row0 = pl.multiple_of(i * block_size, block_size)
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < tq
    q_offset = qoff_ref[()]
    kv_len = kvlen_ref[()]  # already clamped to [0, Tk] by the wrapper
    tiles_per_block = block_size // block_k

    q = load_rows(q_ref, pl.ds(row0, block_q), row_ok)
    head_dim = q.shape[-1]

    def body(t, carry, masked: bool):
        # Tile t of the flattened list: the key block comes from the list as a scalar; only
        # entries below the count are reached, so padding is never read.
        block = kvb_ref[fdiv(t, tiles_per_block)]
        start = block * block_size + lax.rem(t, jnp.int32(tiles_per_block)) * block_k
        start = pl.multiple_of(start, block_k)
        kslice = pl.ds(start, block_k)
        col_ok = None
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)
            col_ok = cols < kv_len
        k = load_rows(k_ref, kslice, col_ok)
        # Raw scores; the scale is folded into the exponent (one FMA per element).
        s = plgpu.dot(q, k, trans_b=True, precision=precision)
        if masked:
            vis = col_ok[None, :]
            if causal:
                vis = vis & (cols[None, :] <= (q_offset + rows)[:, None])
            s = jnp.where(vis, s, NEG_INF)
        return online_softmax_update(
            carry, s, lambda: load_rows(v_ref, kslice, col_ok), scale_log2=scale_log2,
            masked=masked, precision=precision)

    carry = empty_softmax_state(block_q, head_dim)
    n_unmasked = nunm_ref[()]
    carry = lax.fori_loop(0, n_unmasked, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(n_unmasked, nvis_ref[()], functools.partial(body, masked=True), carry)
    o, lse = finish_online_softmax(*carry)
    plgpu.store(o_ref.at[pl.ds(row0, block_q), :], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(row0, block_q)], lse, mask=row_ok)


def _block_sparse_pallas(q, k, v, kv_blocks, counts, q_offset, kv_len, *, causal, sm_scale,
                         out_dtype, interpret, block_size, block_q, block_k, num_warps,
                         num_stages):
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    num_q_blocks = -(-tq // block_size)
    full, hi = _key_ranges(q_offset, kv_len, tq=tq, block_size=block_size, causal=causal)
    n_unmasked, n_visible = _tile_bounds(kv_blocks, counts, full, hi, block_size=block_size,
                                         block_k=block_k)
    kernel = functools.partial(
        _block_sparse_kernel, causal=causal, scale_log2=sm_scale * LOG2E, block_size=block_size,
        block_q=block_q, block_k=block_k, tq=tq, num_q_blocks=num_q_blocks,
        precision=dot_precision(q.dtype))

    def query_block(i):
        return (num_q_blocks - 1 - i) if causal else i

    scalar = pl.BlockSpec((None,), lambda i, bh: (bh // hq,))
    per_program = pl.BlockSpec((None, None, None),
                               lambda i, bh: (bh // hq, bh % hq, query_block(i)))
    list_spec = pl.BlockSpec((None, None, None, kv_blocks.shape[3]),
                             lambda i, bh: (bh // hq, bh % hq, query_block(i), 0))
    q_spec = pl.BlockSpec((None, tq, None, d), lambda i, bh: (bh // hq, 0, bh % hq, 0))
    kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, bh: (bh // hq, 0, (bh % hq) // group, 0))
    lse_spec = pl.BlockSpec((None, None, tq), lambda i, bh: (bh // hq, bh % hq, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch * hq),
        in_specs=[scalar, scalar, list_spec, per_program, per_program, q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, out_dtype),
                   jax.ShapeDtypeStruct((batch, hq, tq), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="block_sparse_attention_with_lse",
    )(q_offset, kv_len, kv_blocks, n_unmasked, n_visible, q, k, v)


_block_sparse_pallas = interpret_aware_jit(
    _block_sparse_pallas, ("causal", "sm_scale", "out_dtype", "interpret", "block_size", "block_q",
                           "block_k", "num_warps", "num_stages"))


def block_sparse_attention_with_lse(
        q: jax.Array, k: jax.Array, v: jax.Array, kv_blocks: jax.Array,
        kv_block_counts: jax.Array, *, block_size: int = 128, causal: bool = False, q_offset: int | jax.Array = 0,
        kv_len: int | jax.Array | None = None, sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
        interpret: bool | None = None, block_k: int | None = None, num_warps: int | None = None,
        num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Flash attention over the listed key blocks of every query block, with GQA and LSE.

    Args:
      q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0 (KV is never repeated);
        D a power of two in [16, 256].
      kv_blocks: int [B, Hq, ceil(Tq / block_size), max_blocks]; row (b, h, i) lists the key
        blocks (block j = keys [j * block_size, (j + 1) * block_size)) that query block i of
        head h attends, ascending and distinct, in [0, ceil(Tk / block_size)) (entries past it
        see no key). May be traced (no recompile).
      kv_block_counts: int [B, Hq, ceil(Tq / block_size)]; only the first counts[b, h, i]
        entries of a row are read, the rest is padding (any value). Clamped to [0, max_blocks].
        May be traced.
      block_size: query and key block size, a power of two >= 16. Static.
      causal, q_offset, kv_len, sm_scale, out_dtype, interpret: as in `attention_with_lse`; the
        visibility rules apply inside every visited block.
      block_k: keys per tile load (a power of two >= 16, at most block_size, shrunk for short
        keys); default `default_attention_config`'s (64 bf16, 32 float32).
      num_warps, num_stages: Triton launch parameters; default `default_attention_config`'s.
        Giving any of block_k, num_warps, num_stages keeps the call on Triton (see the module
        docstring for when it goes to the Hopper kernel instead).

    Returns:
      o [B, Tq, Hq, D] in out_dtype (default q.dtype) and lse [B, Hq, Tq] float32 (natural log).
      Rows with no visible key give o = 0 and lse = -inf. Unlisted key blocks, and listed ones
      no row of the query block can see, are never loaded.
    """
    d, kv_blocks, counts, q_offset, kv_len = _check_block_args(
        q, k, v, kv_blocks, kv_block_counts, block_size, q_offset, kv_len)
    check_pallas_head_dim(d)
    tuned = any(x is not None for x in (block_k, num_warps, num_stages))
    if (runs_on_hopper_kernel(q, k, v, out_dtype, interpret=interpret, tuned=tuned)
            and mgpu_block_sparse.is_supported(q, k, v, block_size=block_size,
                                               out_dtype=out_dtype)):
        return mgpu_block_sparse.block_sparse_attention_with_lse_mgpu(
            q, k, v, kv_blocks, counts, block_size=block_size, causal=bool(causal),
            q_offset=q_offset, kv_len=kv_len, sm_scale=sm_scale, out_dtype=out_dtype)
    cfg = default_attention_config(q.dtype)
    block_k = min(fit_block(block_k or cfg["block_k"], k.shape[1]), block_size)
    return _block_sparse_pallas(
        q, k, v, kv_blocks, counts, q_offset, kv_len, causal=bool(causal),
        sm_scale=check_sm_scale(sm_scale, d), out_dtype=check_out_dtype(out_dtype, q.dtype),
        interpret=resolve_interpret(interpret), block_size=block_size,
        block_q=fit_block(block_size, q.shape[1]), block_k=block_k,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_size"))
def _block_sparse_xla(q, k, v, kv_blocks, counts, q_offset, kv_len, *, causal, sm_scale,
                      block_size):
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    bs = block_size
    nqb, nkb = -(-tq // bs), -(-tk // bs)
    _, hi = _key_ranges(q_offset, kv_len, tq=tq, block_size=bs, causal=causal)
    # Listed blocks that some row of the query block can see; ascending lists make them a
    # prefix, so each query tile's loop stops after the longest such prefix of its heads.
    live = jnp.arange(kv_blocks.shape[3], dtype=jnp.int32) < counts[..., None]
    n_visible = jnp.sum(live & (kv_blocks < cdiv(hi, bs)[:, None, :, None]), axis=-1,
                        dtype=jnp.int32)

    def per_query_tile(x):  # [B, Hq, nqb, ...] -> [nqb, B, Hkv, G, ...]
        x = x.reshape(batch, hkv, group, nqb, *x.shape[3:])
        return jnp.moveaxis(x, 3, 0)

    qt = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, nqb * bs - tq), (0, 0), (0, 0)))
    qt = qt.reshape(batch, nqb, bs, hkv, group, d).transpose(1, 0, 3, 4, 2, 5)

    def key_blocks(x):  # [B, nkb, Hkv, bs, D]; padded keys sit past kv_len <= Tk
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nkb * bs - tk), (0, 0), (0, 0)))
        return x.reshape(batch, nkb, bs, hkv, d).transpose(0, 1, 3, 2, 4)

    kb, vb = key_blocks(k), key_blocks(v)
    b_ix = jnp.arange(batch)[:, None, None]
    h_ix = jnp.arange(hkv)[None, :, None]
    bcast = (slice(None), None, None, None)  # per-batch scalar -> [B, 1, 1, 1]

    def query_tile(args):
        qi, blocks, n_vis, i = args  # [B, Hkv, G, bs, D], [B, Hkv, G, max_blocks], [B, Hkv, G]
        row_pos = q_offset[bcast] + i * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, 1, 1, bs]

        def step(t, carry):
            # Entry t of every head's list at once: each query head gathers its own key block
            # (a [bs, D] tile), so the work is the longest list, not the union of the lists.
            acc, m, l = carry
            block = lax.dynamic_index_in_dim(blocks, t, axis=3, keepdims=False)  # [B, Hkv, G]
            block = jnp.clip(block, 0, nkb - 1)  # padding entries: any in-range tile, masked below
            kj, vj = kb[b_ix, block, h_ix], vb[b_ix, block, h_ix]  # [B, Hkv, G, bs, D]
            # Base-2 units, as AttentionState keeps them.
            s = jnp.einsum("bngrd,bngkd->bngrk", qi, kj, precision=lax.Precision.HIGHEST) * (sm_scale * LOG2E)
            cols = (block * bs)[..., None] + jnp.arange(bs, dtype=jnp.int32)  # [B, Hkv, G, bs]
            vis = (t < n_vis)[..., None] & (cols < kv_len[bcast])
            vis = vis[..., None, :]  # [B, Hkv, G, 1, bs]
            if causal:
                vis = vis & (cols[..., None, :] <= row_pos[..., None])
            s = jnp.where(vis, s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing visible yet
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s - m_use[..., None])
            pv = jnp.einsum("bngrk,bngkd->bngrd", p, vj, precision=lax.Precision.HIGHEST)
            return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

        init = (jnp.zeros((batch, hkv, group, bs, d), jnp.float32),
                jnp.full((batch, hkv, group, bs), NEG_INF, jnp.float32),
                jnp.zeros((batch, hkv, group, bs), jnp.float32))
        return lax.fori_loop(0, jnp.max(n_vis), step, init)

    acc, m, l = lax.map(query_tile, (qt, per_query_tile(kv_blocks), per_query_tile(n_visible),
                                     jnp.arange(nqb, dtype=jnp.int32)))
    # [nqb, B, Hkv, G, bs, ...] -> acc [B, Tq, Hq, D], m and l [B, Hq, Tq]
    acc = acc.transpose(1, 0, 4, 2, 3, 5).reshape(batch, nqb * bs, hq, d)[:, :tq]
    m, l = (x.transpose(1, 2, 3, 0, 4).reshape(batch, hq, nqb * bs)[..., :tq] for x in (m, l))
    return finish_state(AttentionState(acc, m, l))


def block_sparse_attention_with_lse_xla(
        q: jax.Array, k: jax.Array, v: jax.Array, kv_blocks: jax.Array,
        kv_block_counts: jax.Array, *, block_size: int = 128, causal: bool = False, q_offset: int | jax.Array = 0,
        kv_len: int | jax.Array | None = None, sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
        interpret: bool | None = None, block_k: int | None = None, num_warps: int | None = None,
        num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """jnp twin of `block_sparse_attention_with_lse` (same arguments and results; `interpret`,
    `block_k`, `num_warps` and `num_stages` are ignored; any head_dim).

    Exact float32 (Precision.HIGHEST dots, float32 softmax statistics). Works in query tiles of
    block_size rows; step t of a tile's loop gathers entry t of every head's list (one
    [block_size, D] key tile per query head, KV never repeated in memory) and runs one online
    softmax step for all heads, so a tile costs as many steps as its longest visible list.
    """
    del interpret, block_k, num_warps, num_stages
    d, kv_blocks, counts, q_offset, kv_len = _check_block_args(
        q, k, v, kv_blocks, kv_block_counts, block_size, q_offset, kv_len)
    out_dtype = check_out_dtype(out_dtype, q.dtype)
    o, lse = _block_sparse_xla(q, k, v, kv_blocks, counts, q_offset, kv_len, causal=bool(causal),
                               sm_scale=check_sm_scale(sm_scale, d), block_size=block_size)
    return o.astype(out_dtype), lse
