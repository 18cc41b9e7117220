"""Decode attention (one new query token per sequence) with LSE, split over the keys.

`decode_attention_with_lse` launches one program per (key split, batch, KV head); each
program attends the whole query-head group of its KV head to its slice of keys, so KV is
read once per group and never repeated. The per-split states are merged in float32.
`decode_attention_with_lse_xla` is the jnp twin. `decode_state` is the engine's form: fixed-length splits
folded into a running float32 `AttentionState` in key order, so keys streamed in pieces give one call's bits.

Semantics: q [B, Hq, D] sees keys j < kv_len of k/v [B, S, Hkv, D]; o [B, Hq, D] in q.dtype
(or `out_dtype`),
lse [B, Hq] float32 natural log; a row with kv_len = 0 gets o = 0 and lse = -inf.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    _TARGET_PROGRAMS,
    check_pallas_head_dim,
    decode_key_tile,
    empty_softmax_state,
    finish_online_softmax,
    LOG2E,
    MIN_BLOCK,
    cdiv,
    check_attention_shapes,
    check_out_dtype,
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
from pallas_kernels.attention import attention_with_lse_xla
from pallas_kernels.fold import fold_splits
from pallas_kernels.merge import merge_stack
from pallas_kernels.state import AttentionState, check_state

# Keys per split of the engine's batch-invariant decode, by the sequence's length L alone (not the batch): the power
# of two at or below L / DECODE_SPLITS within DECODE_SPLIT_MIN..DECODE_SPLIT_MAX keys, so 16 to 32 splits up to 128K.
# At least 16 spread a batch of one over the SMs (8 KV heads x 16 splits: 128 programs); at most 32 keep the fold's
# chain short (one split after another: fixed 1,024-key splits folded 128 at 128K in 0.44 ms of a 9.6 ms step on an
# H200). Rounding up instead left 9 splits just past 32K (72 programs): 1.155x the default's step. Offloaded blocks
# that are multiples of the split at the sequence's length give the in-GPU bits: DECODE_SPLIT_MAX always
# (bench/results/runs/h200_invariant_price/).
DECODE_SPLITS = 16
DECODE_SPLIT_MIN, DECODE_SPLIT_MAX = 512, 4096


def decode_split_lens(total_lens: jax.Array) -> jax.Array:
    """Keys per split of sequences of `total_lens` keys (int32 [B]), as `decode_state` and `paged_decode_state`
    cut them by default: the power of two at or below ceil(L / DECODE_SPLITS), clipped to DECODE_SPLIT_MIN..MAX."""
    want = jnp.maximum(cdiv(total_lens.astype(jnp.int32), DECODE_SPLITS), 1)
    return jnp.clip(jnp.left_shift(jnp.int32(1), 31 - lax.clz(want)), DECODE_SPLIT_MIN, DECODE_SPLIT_MAX)


def decode_split_len(total_len: int) -> int:
    """`decode_split_lens` of one length, as a Python int: the split at the longest length a sequence reaches is the
    largest it ever gets (split lengths do not shrink as a sequence grows)."""
    return int(decode_split_lens(jnp.array([total_len], jnp.int32))[0])


def max_decode_splits(max_len: int) -> int:
    """The most splits `decode_split_lens` cuts a sequence of at most `max_len` keys into: 512-key splits up to
    16,368 keys (32 of them there), 4,096-key ones past 65,520."""
    return max(min(-(-max_len // DECODE_SPLIT_MIN), 2 * DECODE_SPLITS), -(-max_len // DECODE_SPLIT_MAX))


def decode_splits(split_len: int | None, total_lens: jax.Array, max_keys: int,
                  whole: bool) -> tuple[jax.Array, int, int]:
    """How a call over at most `max_keys` keys cuts each sequence: (keys per split, int32 [B]; the least of them any
    sequence can get; split slots, enough for every sequence), static but the first. `split_len` for all, or None
    for `decode_split_lens` of the sequences' total lengths, fewer slots where the call holds whole sequences
    (`whole`) than pieces of longer ones."""
    if split_len is None:
        slots = max_decode_splits(max_keys) if whole else -(-max_keys // DECODE_SPLIT_MIN)
        return decode_split_lens(total_lens), DECODE_SPLIT_MIN, slots
    if split_len < MIN_BLOCK or split_len % MIN_BLOCK:
        raise ValueError(f"split_len={split_len}; allowed: None or a positive multiple of {MIN_BLOCK}")
    return jnp.full(total_lens.shape, split_len, jnp.int32), int(split_len), -(-max_keys // split_len)


def default_decode_config(dtype: jnp.dtype) -> dict[str, int]:
    """Launch parameters tuned on an H200 (see bench/bench_kernels.py)."""
    if jnp.dtype(dtype) == jnp.float32:
        return dict(block_k=32, num_warps=4, num_stages=2)
    return dict(block_k=128, num_warps=4, num_stages=3)


def _decode_kernel(kvlen_ref, split_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2: float,
                   block_k: int, group: int, precision):
    split = pl.program_id(0)
    kv_len = kvlen_ref[()]
    split_len = split_ref[()]
    start = split * split_len
    n_keys = jnp.clip(kv_len - start, 0, split_len)
    n_full = fdiv(n_keys, block_k)
    n_blocks = cdiv(n_keys, block_k)
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    # Rows past the group are zero queries; they are computed (tensor-core tiles are >= 16
    # rows) and never stored.
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)

    def body(j, carry, masked: bool):
        kslice = pl.ds(pl.multiple_of(start + j * block_k, block_k), block_k)
        col_ok = (j * block_k + jnp.arange(block_k, dtype=jnp.int32)) < n_keys if masked else None
        return decode_key_tile(carry, q, k_ref, v_ref, kslice, kslice, col_ok, scale_log2=scale_log2,
                               precision=precision)

    carry = empty_softmax_state(block_h, q.shape[-1])
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)
    o, lse = finish_online_softmax(*carry)
    plgpu.store(o_ref, o, mask=row_ok[:, None])
    plgpu.store(lse_ref, lse, mask=row_ok)


def _decode_parts(q, k, v, kv_len, split_lens, *, sm_scale, interpret, block_k, num_splits, num_warps, num_stages):
    """Unmerged float32 states of consecutive key splits, sequence b's of split_lens[b] keys (a multiple of block_k):
    o [num_splits, B, Hkv, group, D], natural-log lse [num_splits, B, Hkv, group]; a split past kv_len holds no key
    (o = 0, lse = -inf)."""
    batch, hq, d = q.shape
    _, seq, hkv, _ = k.shape
    group = hq // hkv
    block_h = max(MIN_BLOCK, next_pow2(group))
    kernel = functools.partial(
        _decode_kernel, scale_log2=sm_scale * LOG2E, block_k=block_k, group=group, precision=dot_precision(q.dtype))
    qg = q.reshape(batch, hkv, group, d)
    return pl.pallas_call(
        kernel,
        grid=(num_splits, batch * hkv),
        in_specs=[
            pl.BlockSpec((None,), lambda s, bh: (bh // hkv,)),
            pl.BlockSpec((None,), lambda s, bh: (bh // hkv,)),
            # The query block is padded past the group to a full tensor-core tile.
            pl.BlockSpec((None, None, block_h, d), lambda s, bh: (bh // hkv, bh % hkv, 0, 0)),
            pl.BlockSpec((None, seq, None, d), lambda s, bh: (bh // hkv, 0, bh % hkv, 0)),
            pl.BlockSpec((None, seq, None, d), lambda s, bh: (bh // hkv, 0, bh % hkv, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, d),
                         lambda s, bh: (s, bh // hkv, bh % hkv, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda s, bh: (s, bh // hkv, bh % hkv, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, batch, hkv, group, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, hkv, group), jnp.float32),
        ],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="decode_attention_with_lse",
    )(kv_len, split_lens, qg, k, v)


_decode_parts = interpret_aware_jit(
    _decode_parts, ("sm_scale", "interpret", "block_k", "num_splits", "num_warps", "num_stages"))


def _decode_pallas(q, k, v, kv_len, *, sm_scale, out_dtype, interpret, block_k, num_splits,
                   num_warps, num_stages):
    batch, hq, d = q.shape
    seq = k.shape[1]
    split_len = -(-(-(-seq // num_splits)) // block_k) * block_k
    o_part, lse_part = _decode_parts(q, k, v, kv_len, jnp.full((batch,), split_len, jnp.int32), sm_scale=sm_scale,
                                     interpret=interpret, block_k=block_k, num_splits=-(-seq // split_len),
                                     num_warps=num_warps, num_stages=num_stages)
    o, lse = merge_stack(o_part, lse_part)
    return o.reshape(batch, hq, d).astype(out_dtype), lse.reshape(batch, hq)


_decode_pallas = interpret_aware_jit(
    _decode_pallas, ("sm_scale", "out_dtype", "interpret", "block_k", "num_splits", "num_warps",
                     "num_stages"))


def decode_attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, *, kv_len: int | jax.Array | None = None,
                              sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
                              interpret: bool | None = None,
                              block_k: int | None = None, num_splits: int | None = None,
                              num_warps: int | None = None,
                              num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of one query token per sequence over a KV cache, with LSE.

    Args:
      q: [B, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0.
      kv_len: keys j >= kv_len are invisible; int or int32 array (scalar or [B]), may be
        traced (no recompile); None means S. Clamped to [0, S]. Splits past kv_len load nothing.
      sm_scale: score scale, default 1/sqrt(D). Static.
      out_dtype: dtype of o, default q.dtype. Static; float32 keeps the merged split states
        unrounded.
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      block_k: keys per inner step (power of two >= 16); num_splits: key splits (static),
        default gives ~128 programs on a GPU (4 splits in interpret mode); num_warps, num_stages: Triton launch params.

    Returns:
      o [B, Hq, D] in out_dtype (default q.dtype) and lse [B, Hq] float32 (natural log).
    """
    batch, _, hq, seq, hkv, d = check_attention_shapes(q, k, v, 3)
    check_pallas_head_dim(d)
    cfg = default_decode_config(q.dtype)
    block_k = fit_block(block_k or cfg["block_k"], seq)
    interpret = resolve_interpret(interpret)
    if num_splits is None:
        # Interpret mode runs programs one after another, so extra splits only cost time.
        num_splits = 4 if interpret else -(-_TARGET_PROGRAMS // (batch * hkv))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}; allowed: >= 1")
    num_splits = min(num_splits, -(-seq // block_k))
    kv_len = jnp.clip(per_batch(seq if kv_len is None else kv_len, batch, "kv_len"), 0, seq)
    return _decode_pallas(
        q, k, v, kv_len, sm_scale=check_sm_scale(sm_scale, d),
        out_dtype=check_out_dtype(out_dtype, q.dtype), interpret=interpret, block_k=block_k, num_splits=int(num_splits),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])


def decode_attention_with_lse_xla(q: jax.Array, k: jax.Array, v: jax.Array, *, kv_len: int | jax.Array | None = None,
                                  sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
                                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """jnp twin of `decode_attention_with_lse` (exact float32 statistics; `interpret` ignored)."""
    check_attention_shapes(q, k, v, 3)
    o, lse = attention_with_lse_xla(q[:, None], k, v, kv_len=kv_len, sm_scale=sm_scale,
                                    out_dtype=out_dtype)
    return o[:, 0], lse[..., 0]


def decode_state(q: jax.Array, k: jax.Array, v: jax.Array, state: AttentionState, *,
                 kv_len: int | jax.Array | None = None, sm_scale: float | None = None, split_len: int | None = None,
                 total_len: int | jax.Array | None = None, interpret: bool | None = None) -> AttentionState:
    """Continues the attention state of one query token per sequence over k/v, split for parallelism.

    The keys are cut into consecutive splits, each attended by its own programs, and the splits' float32 states
    are folded into `state` one after another in ascending key order. A split's length depends on the sequence's
    whole length alone (`decode_split_lens`), so attention over keys that arrive in pieces (blocks streamed from
    the host, then the GPU tail) whose lengths are multiples of it ends in the same bits as one call over all of
    them, given the same `total_len`: offloaded decode reproduces in-GPU decode exactly. Splits past kv_len hold no
    key and are not folded.

    Args:
      q: [B, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0.
      state: AttentionState with acc [B, 1, Hq, D], m and l [B, Hq, 1].
      kv_len: keys j >= kv_len are invisible (int or int32 array, scalar or [B]); None means S.
      split_len: keys per split (static), a multiple of 16; None: `decode_split_lens(total_len)`.
      total_len: the sequence's keys in all its pieces (int or int32, scalar or [B]), which sets the split length
        when split_len is None; None means kv_len (this call holds all of them).
    """
    batch, _, hq, seq, hkv, d = check_attention_shapes(q, k, v, 3)
    check_pallas_head_dim(d)
    check_state(state, batch, 1, hq, d)
    cfg = default_decode_config(q.dtype)
    kv_len = jnp.clip(per_batch(seq if kv_len is None else kv_len, batch, "kv_len"), 0, seq)
    split_lens, min_split, slots = decode_splits(
        split_len, kv_len if total_len is None else per_batch(total_len, batch, "total_len"), seq, total_len is None)
    block_k = fit_block(math.gcd(cfg["block_k"], min_split), seq)
    interpret = resolve_interpret(interpret)
    o_part, lse_part = _decode_parts(
        q, k, v, kv_len, split_lens, sm_scale=check_sm_scale(sm_scale, d), interpret=interpret, block_k=block_k,
        num_splits=slots, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return fold_splits(state, o_part, lse_part, cdiv(kv_len, split_lens), interpret=interpret)
