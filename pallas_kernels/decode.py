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

# Keys per split of `decode_state`, the engine's batch-invariant and offloaded decode: offload block sizes that are
# multiples of it give the in-GPU bits. Against 256, 1,024 keys write a quarter of the float32 split states and
# shorten the fold's chain 4x: batch-invariant attention within 0.15 ms of the default's at 8K-128K on an H200
# (bench/results/runs/h200_invariant_price/).
DECODE_SPLIT = 1024


def default_decode_config(dtype: jnp.dtype) -> dict[str, int]:
    """Launch parameters tuned on an H200 (see bench/bench_kernels.py)."""
    if jnp.dtype(dtype) == jnp.float32:
        return dict(block_k=32, num_warps=4, num_stages=2)
    return dict(block_k=128, num_warps=4, num_stages=3)


def _decode_kernel(kvlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2: float,
                   block_k: int, split_len: int, group: int, precision):
    split = pl.program_id(0)
    kv_len = kvlen_ref[()]
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


def _decode_parts(q, k, v, kv_len, *, sm_scale, interpret, block_k, split_len, num_warps, num_stages):
    """Unmerged float32 states of consecutive key splits of `split_len` keys (a multiple of block_k):
    o [num_splits, B, Hkv, group, D], natural-log lse [num_splits, B, Hkv, group]."""
    batch, hq, d = q.shape
    _, seq, hkv, _ = k.shape
    group = hq // hkv
    block_h = max(MIN_BLOCK, next_pow2(group))
    num_splits = -(-seq // split_len)
    kernel = functools.partial(
        _decode_kernel, scale_log2=sm_scale * LOG2E, block_k=block_k, split_len=split_len,
        group=group, precision=dot_precision(q.dtype))
    qg = q.reshape(batch, hkv, group, d)
    return pl.pallas_call(
        kernel,
        grid=(num_splits, batch * hkv),
        in_specs=[
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
    )(kv_len, qg, k, v)


_decode_parts = interpret_aware_jit(
    _decode_parts, ("sm_scale", "interpret", "block_k", "split_len", "num_warps", "num_stages"))


def _decode_pallas(q, k, v, kv_len, *, sm_scale, out_dtype, interpret, block_k, num_splits,
                   num_warps, num_stages):
    batch, hq, d = q.shape
    seq = k.shape[1]
    split_len = -(-(-(-seq // num_splits)) // block_k) * block_k
    o_part, lse_part = _decode_parts(q, k, v, kv_len, sm_scale=sm_scale, interpret=interpret, block_k=block_k,
                                     split_len=split_len, num_warps=num_warps, num_stages=num_stages)
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
                 kv_len: int | jax.Array | None = None, sm_scale: float | None = None, split_len: int = DECODE_SPLIT,
                 interpret: bool | None = None) -> AttentionState:
    """Continues the attention state of one query token per sequence over k/v, split for parallelism.

    The keys are cut into consecutive splits of `split_len` keys, each attended by its own programs, and the
    splits' float32 states are folded into `state` one after another in ascending key order. So attention over
    keys that arrive in pieces (blocks streamed from the host, then the GPU tail) whose lengths are multiples
    of `split_len` ends in the same bits as one call over all of them: offloaded decode reproduces in-GPU
    decode exactly. Splits past kv_len hold no key and leave the state unchanged bit for bit.

    Args:
      q: [B, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0.
      state: AttentionState with acc [B, 1, Hq, D], m and l [B, Hq, 1].
      kv_len: keys j >= kv_len are invisible (int or int32 array, scalar or [B]); None means S.
      split_len: keys per split (static), a multiple of 16.
    """
    batch, _, hq, seq, hkv, d = check_attention_shapes(q, k, v, 3)
    check_pallas_head_dim(d)
    check_state(state, batch, 1, hq, d)
    if split_len < MIN_BLOCK or split_len % MIN_BLOCK:
        raise ValueError(f"split_len={split_len}; allowed: a positive multiple of {MIN_BLOCK}")
    cfg = default_decode_config(q.dtype)
    block_k = fit_block(math.gcd(cfg["block_k"], split_len), seq)
    split_len = min(split_len, -(-seq // block_k) * block_k)
    kv_len = jnp.clip(per_batch(seq if kv_len is None else kv_len, batch, "kv_len"), 0, seq)
    o_part, lse_part = _decode_parts(
        q, k, v, kv_len, sm_scale=check_sm_scale(sm_scale, d), interpret=resolve_interpret(interpret),
        block_k=block_k, split_len=split_len, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return fold_splits(state, o_part, lse_part, interpret=resolve_interpret(interpret))
