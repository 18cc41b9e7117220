"""Prefill attention that also returns the log-sum-exp (LSE) of every query row.

`attention_with_lse` is a Pallas kernel (Triton on NVIDIA GPUs, interpreted elsewhere);
`attention_with_lse_xla` is a plain jnp version with the same signature and semantics, used
where interpret mode is too slow (whole models on the CPU).

Semantics shared by both:
  q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]; query head h reads KV head h // (Hq // Hkv).
  Query i sits at absolute position q_offset + i, or q_positions[i] when given (queries picked from a longer
  sequence, ascending); key j at position j.
  Key j is visible to query i iff kv_start[i] <= j < kv_len and (not causal or j <= position of query i);
  kv_start (optional, per query row) packs several sequences into one row of the batch: each query
  then sees only the keys of its own sequence.
  o [B, Tq, Hq, D] in q.dtype, or in `out_dtype` when given (float32 keeps a partial state
  unrounded until the caller merges it); lse [B, Hq, Tq] float32, natural log.
  A row that sees no key gets lse = -inf and o = 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mgpu_attention
from pallas_kernels._common import (
    check_pallas_head_dim,
    empty_softmax_state,
    finish_online_softmax,
    load_rows,
    online_softmax_update,
    LOG2E,
    NEG_INF,
    cdiv,
    check_attention_shapes,
    check_out_dtype,
    check_sm_scale,
    compiler_params,
    dot_precision,
    fdiv,
    fit_block,
    hopper_kernels_allowed,
    interpret_aware_jit,
    per_batch,
    per_row,
    resolve_interpret,
)
from pallas_kernels.state import AttentionState, check_state, empty_state, finish_state


def default_attention_config(dtype: jnp.dtype) -> dict[str, int]:
    """Block sizes and launch parameters tuned on an H200 (see bench/bench_kernels.py).

    float32 uses exact (non-tf32) dots, which run on CUDA cores and need smaller tiles.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return dict(block_q=64, block_k=32, num_warps=4, num_stages=2)
    return dict(block_q=128, block_k=64, num_warps=4, num_stages=2)


def _attention_kernel(qoff_ref, kvlen_ref, q_ref, k_ref, v_ref, *refs, causal: bool,
                      scale_log2: float, block_q: int, block_k: int, tq: int, num_q_blocks: int,
                      precision, positions: bool, starts: bool, resume: bool, finish: bool):
    state_and_out_refs = refs
    if positions:
        pos_ref, *state_and_out_refs = state_and_out_refs
    if starts:
        start_ref, *state_and_out_refs = state_and_out_refs
    if resume:
        acc0_ref, m0_ref, l0_ref, *out_refs = state_and_out_refs
    else:
        out_refs = state_and_out_refs
    pid = pl.program_id(0)
    # Causal: the last query blocks carry the most work, so launch them first.
    i = (num_q_blocks - 1 - pid) if causal else pid
    row0 = pl.multiple_of(i * block_q, block_q)
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < tq
    q_offset = qoff_ref[()]
    kv_len = kvlen_ref[()]  # already clamped to [0, Tk] by the wrapper
    row_slice = pl.ds(row0, block_q)

    q = load_rows(q_ref, row_slice, row_ok)
    head_dim = q.shape[-1]

    # Keys [0, hi) may be visible to some row of this block; blocks below n_full are visible
    # to every row, so they skip all masking.
    if positions:  # padding rows see no key
        row_pos = plgpu.load(pos_ref.at[row_slice], mask=row_ok, other=-1)
    else:
        row_pos = q_offset + rows
    if causal and positions:
        hi = jnp.clip(jnp.max(row_pos) + 1, 0, kv_len)
        n_full = fdiv(jnp.clip(jnp.min(jnp.where(row_ok, row_pos, hi)) + 1, 0, kv_len), block_k)
    elif causal:
        last_row = jnp.minimum(row0 + block_q, tq) - 1
        hi = jnp.clip(q_offset + last_row + 1, 0, kv_len)
        n_full = fdiv(jnp.clip(q_offset + row0 + 1, 0, kv_len), block_k)
    else:
        hi = kv_len
        n_full = fdiv(kv_len, block_k)
    n_blocks = cdiv(hi, block_k)
    n_full = jnp.minimum(n_full, n_blocks)
    # Key blocks [first, n_blocks) may be visible; [lo_full, hi_full) are visible to every row of this block.
    lo_full, hi_full = jnp.int32(0), n_full
    if starts:
        start_rows = plgpu.load(start_ref.at[row_slice], mask=row_ok, other=0)
        lowest = jnp.min(jnp.where(row_ok, start_rows, hi))
        highest = jnp.max(jnp.where(row_ok, start_rows, 0))
        first = jnp.minimum(fdiv(jnp.clip(lowest, 0, hi), block_k), n_blocks)
        lo_full = jnp.clip(cdiv(jnp.maximum(highest, 0), block_k), first, n_blocks)
        hi_full = jnp.clip(n_full, lo_full, n_blocks)

    def body(j, carry, masked: bool):
        start = pl.multiple_of(j * block_k, block_k)
        kslice = pl.ds(start, block_k)
        col_ok = None
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)
            col_ok = cols < kv_len
        k = load_rows(k_ref, kslice, col_ok)
        # Raw scores; the scale is folded into the exponent below (one FMA per element).
        s = plgpu.dot(q, k, trans_b=True, precision=precision)
        if masked:
            vis = col_ok[None, :]
            if causal:
                vis = vis & (cols[None, :] <= row_pos[:, None])
            if starts:
                vis = vis & (cols[None, :] >= start_rows[:, None])
            s = jnp.where(vis, s, NEG_INF)
        return online_softmax_update(
            carry, s, lambda: load_rows(v_ref, kslice, col_ok), scale_log2=scale_log2,
            masked=masked, precision=precision)

    if resume:  # continue an online softmax over earlier keys, exactly where it stopped
        carry = (load_rows(acc0_ref, row_slice, row_ok),
                 plgpu.load(m0_ref.at[row_slice], mask=row_ok, other=NEG_INF),
                 plgpu.load(l0_ref.at[row_slice], mask=row_ok, other=0.0))
    else:
        carry = empty_softmax_state(block_q, head_dim)
    if starts:
        carry = lax.fori_loop(first, lo_full, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(lo_full, hi_full, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(hi_full, n_blocks, functools.partial(body, masked=True), carry)
    if finish:
        o_ref, lse_ref = out_refs
        o, lse = finish_online_softmax(*carry)
        plgpu.store(o_ref.at[row_slice, :], o.astype(o_ref.dtype), mask=row_ok[:, None])
        plgpu.store(lse_ref.at[row_slice], lse, mask=row_ok)
    else:
        for ref, x in zip(out_refs, carry):
            plgpu.store(ref.at[row_slice, :] if x.ndim == 2 else ref.at[row_slice], x,
                        mask=row_ok[:, None] if x.ndim == 2 else row_ok)


def _attention_pallas(q, k, v, q_offset, kv_len, q_positions, kv_start, state, *, causal, sm_scale, out_dtype, finish,
                      interpret, block_q, block_k, num_warps, num_stages):
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    num_q_blocks = -(-tq // block_q)
    kernel = functools.partial(
        _attention_kernel, causal=causal, scale_log2=sm_scale * LOG2E, block_q=block_q,
        block_k=block_k, tq=tq, num_q_blocks=num_q_blocks, precision=dot_precision(q.dtype),
        positions=q_positions is not None, starts=kv_start is not None, resume=state is not None, finish=finish)
    scalar = pl.BlockSpec((None,), lambda i, bh: (bh // hq,))
    q_spec = pl.BlockSpec((None, tq, None, d), lambda i, bh: (bh // hq, 0, bh % hq, 0))
    kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, bh: (bh // hq, 0, (bh % hq) // group, 0))
    lse_spec = pl.BlockSpec((None, None, tq), lambda i, bh: (bh // hq, bh % hq, 0))
    rows_f32 = jax.ShapeDtypeStruct((batch, hq, tq), jnp.float32)
    if finish:
        out_specs = [q_spec, lse_spec]
        out_shape = [jax.ShapeDtypeStruct(q.shape, out_dtype), rows_f32]
    else:
        out_specs = [q_spec, lse_spec, lse_spec]
        out_shape = [jax.ShapeDtypeStruct(q.shape, jnp.float32), rows_f32, rows_f32]
    row_spec = pl.BlockSpec((None, tq), lambda i, bh: (bh // hq, 0))
    per_row_args = tuple(x for x in (q_positions, kv_start) if x is not None)
    row_specs = [row_spec] * len(per_row_args)
    state_specs, state_args = ([q_spec, lse_spec, lse_spec], tuple(state)) if state is not None else ([], ())
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch * hq),
        in_specs=[scalar, scalar, q_spec, kv_spec, kv_spec] + row_specs + state_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="attention_with_lse" if finish else "attention_state",
    )(q_offset, kv_len, q, k, v, *per_row_args, *state_args)
    return tuple(out) if finish else AttentionState(*out)


_attention_pallas = interpret_aware_jit(
    _attention_pallas, ("causal", "sm_scale", "out_dtype", "finish", "interpret", "block_q",
                        "block_k", "num_warps", "num_stages"))


def runs_on_hopper_kernel(q: jax.Array, k: jax.Array, v: jax.Array, out_dtype: jnp.dtype | None = None, *,
                          finish: bool = True, interpret: bool | None = None, q_positions: jax.Array | None = None,
                          tuned: bool = False) -> bool:
    """Whether `attention_with_lse` / `attention_state` take the Hopper kernel (`mgpu_attention`: Mosaic GPU, TMA
    loads, wgmma, warp specialisation) for these arguments rather than the Triton one: on an sm_90 GPU, with
    bfloat16 or float16 inputs and D 64 or 128, unless the queries are picked by position (`q_positions`: `_launch`
    then reverses the keys for it where it finishes one call), Triton launch parameters are given (`tuned`) or the
    environment sets JAX_OFFLOAD_HOPPER_ATTENTION=0. The choice depends on nothing that differs between the calls of
    one model's prefill (in GPU memory, chunked, offloaded), so those keep one another's bits."""
    if resolve_interpret(interpret) or q_positions is not None or tuned:
        return False
    if not hopper_kernels_allowed():
        return False
    return mgpu_attention.is_supported(q, k, v, out_dtype=check_out_dtype(out_dtype, q.dtype), finish=finish)


def _launch(q, k, v, state, *, causal, q_offset, kv_len, sm_scale, out_dtype, finish, interpret,
            block_q, block_k, num_warps, num_stages, kv_start=None, q_positions=None):
    batch, tq, hq, tk, hkv, d = check_attention_shapes(q, k, v, 4)
    check_pallas_head_dim(d)
    if state is not None:
        check_state(state, batch, tq, hq, d)
    cfg = default_attention_config(q.dtype)
    q_offset = per_batch(q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    tuned = any(x is not None for x in (block_q, block_k, num_warps, num_stages))
    if (q_positions is not None and kv_start is None and state is None and finish
            and runs_on_hopper_kernel(q, k, v, out_dtype, interpret=interpret, tuned=tuned)):
        # The Hopper kernel knows each row's first key, not its last: over the keys reversed, a row whose last visible
        # key is j sees keys from tk-1-j on (CacheBlend's picked rows: 2.7 ms against 4.1 for the Triton kernel on
        # an H200, bench/results/runs/h200_kv_reuse/blend_parts/).
        positions = per_row(q_positions, batch, tq, "q_positions")
        last = jnp.minimum(kv_len[:, None] - 1, positions) if causal else kv_len[:, None] - 1
        return _launch(q, jnp.flip(k, 1), jnp.flip(v, 1), None, causal=False, q_offset=0, kv_len=None,
                       sm_scale=sm_scale, out_dtype=out_dtype, finish=True, interpret=interpret, block_q=None,
                       block_k=None, num_warps=None, num_stages=None,
                       kv_start=jnp.broadcast_to(tk - 1 - last, (batch, tq)).astype(jnp.int32))
    if runs_on_hopper_kernel(q, k, v, out_dtype, finish=finish, interpret=interpret, q_positions=q_positions,
                             tuned=tuned):
        hopper = dict(causal=bool(causal), q_offset=q_offset, kv_lengths=kv_len, sm_scale=check_sm_scale(sm_scale, d),
                      kv_start=per_row(kv_start, batch, tq), state=state)
        if finish:
            return mgpu_attention.attention_with_lse_mgpu(q, k, v, out_dtype=check_out_dtype(out_dtype, q.dtype),
                                                          **hopper)
        return mgpu_attention.attention_state_mgpu(q, k, v, **hopper)
    return _attention_pallas(
        q, k, v, q_offset, kv_len, per_row(q_positions, batch, tq, "q_positions"), per_row(kv_start, batch, tq),
        state, causal=bool(causal),
        sm_scale=check_sm_scale(sm_scale, d), out_dtype=check_out_dtype(out_dtype, q.dtype),
        finish=finish, interpret=resolve_interpret(interpret),
        block_q=fit_block(block_q or cfg["block_q"], tq), block_k=fit_block(block_k or cfg["block_k"], tk),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])


def attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                       q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
                       kv_start: jax.Array | None = None, q_positions: jax.Array | None = None,
                       sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
                       state: AttentionState | None = None, interpret: bool | None = None, block_q: int | None = None,
                       block_k: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Flash attention forward with GQA, causal offset, per-batch key length and LSE.

    Args:
      q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0 (KV is never repeated).
      causal: query i sees key j only if j <= q_offset + i.
      q_offset: absolute position of query 0; int or int32 array (scalar or [B]); may be traced.
      kv_len: keys j >= kv_len are invisible; int or int32 array (scalar or [B]); may be traced;
        None means Tk. Values are clamped to [0, Tk].
      kv_start: int32 [B, Tq] or None; query i sees no key j < kv_start[b, i]. Sequences packed one
        after another into a row give each query its sequence's first position, so no query sees
        another sequence. Key blocks below a query block's smallest start are never loaded.
      q_positions: int32 [B, Tq] or None; the queries' positions, replacing q_offset + i: queries
        picked from a longer sequence (ascending, so that each query block skips the key blocks past
        its last query). Padding rows may take any position.
      sm_scale: score scale, default 1/sqrt(D). Static.
      out_dtype: dtype of o, default q.dtype. Static. float32 returns the kernel's float32
        accumulator unrounded, for states that will be merged.
      state: an `AttentionState` over earlier keys (from `attention_state`) to continue: the result
        covers those keys and these, computed exactly as one call over all of them would.
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      block_q, block_k, num_warps, num_stages: launch parameters (powers of two >= 16 for
        blocks); None takes `default_attention_config`.

    Returns:
      o [B, Tq, Hq, D] in out_dtype (default q.dtype) and lse [B, Hq, Tq] float32 (natural log). Rows with no
      visible key give o = 0 and lse = -inf. Key blocks that no row of a query block can see
      are never loaded, so a fully masked call costs only the launch.
    """
    return _launch(q, k, v, state, causal=causal, q_offset=q_offset, kv_len=kv_len, sm_scale=sm_scale,
                   out_dtype=out_dtype, finish=True, interpret=interpret, block_q=block_q, block_k=block_k,
                   num_warps=num_warps, num_stages=num_stages, kv_start=kv_start, q_positions=q_positions)


def attention_state(q: jax.Array, k: jax.Array, v: jax.Array, state: AttentionState | None = None, *,
                    causal: bool = False, q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
                    kv_start: jax.Array | None = None, q_positions: jax.Array | None = None,
                    sm_scale: float | None = None,
                    interpret: bool | None = None, block_q: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> AttentionState:
    """The kernel of `attention_with_lse` stopped before its final normalisation: continues `state` (None:
    no key seen yet) over k, v and returns the raw float32 online-softmax state. Keys streamed in blocks
    whose sizes are multiples of block_k, in ascending order, with the last call made through
    `attention_with_lse(state=...)`, give the bits of one call over all the keys.
    """
    return _launch(q, k, v, state, causal=causal, q_offset=q_offset, kv_len=kv_len, sm_scale=sm_scale,
                   out_dtype=None, finish=False, interpret=interpret, block_q=block_q, block_k=block_k,
                   num_warps=num_warps, num_stages=num_stages, kv_start=kv_start, q_positions=q_positions)


# The jnp twin. It continues an online softmax (`AttentionState`) in steps of _GRANULE keys at absolute
# key positions, and every dot and sum has one fixed shape (one batch row, _TWIN_ROWS or 1 query rows x
# _TWIN_KEYS keys), because XLA's CPU dots and reductions round differently for different shapes, the batch
# size included (batched, a row's bits changed with the batch: a 16-key sum and the P.V dot). Batch rows run one
# after another, as the kernels give each row programs of its own, so a row's bits do not depend on the rows
# beside it. Keys that arrive in blocks (any multiple of _GRANULE, in ascending order) give exactly the bits of
# one call over all of them: fully masked granules leave the state untouched, bit for bit.
_TWIN_ROWS = 128
_TWIN_KEYS = 128
_GRANULE = 16


@functools.partial(jax.jit, static_argnames=("causal", "scale_log2"))
def _attention_state_xla(q, k, v, state, q_offset, kv_len, q_positions, kv_start, *, causal, scale_log2):
    args = (q, k, v, state, q_offset, kv_len, q_positions, kv_start)
    if q.shape[0] == 1:
        return _row_state_xla(*args, causal=causal, scale_log2=scale_log2)

    def one(row):
        out = _row_state_xla(*jax.tree.map(lambda x: x[None], row), causal=causal, scale_log2=scale_log2)
        return jax.tree.map(lambda x: x[0], out)

    return lax.map(one, args)


def _row_state_xla(q, k, v, state, q_offset, kv_len, q_positions, kv_start, *, causal, scale_log2):
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    rows = 1 if tq == 1 else _TWIN_ROWS
    per_tile = _TWIN_KEYS // _GRANULE
    nq, nk = -(-tq // rows), -(-tk // _TWIN_KEYS)

    def query_tiles(x):  # [B, T, Hq, ...] -> [nq, B, Hkv, G, rows, ...]
        x = jnp.pad(x, [(0, 0), (0, nq * rows - tq)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, nq, rows, hkv, group, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3, 4), (0, 2, 3))

    def key_tiles(x):  # [nk, B, Hkv, per_tile, _GRANULE, D]; padded keys sit past kv_len <= Tk
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nk * _TWIN_KEYS - tk), (0, 0), (0, 0)))
        return x.reshape(batch, nk, per_tile, _GRANULE, hkv, d).transpose(1, 0, 4, 2, 3, 5)

    qt = query_tiles(q.astype(jnp.float32))
    acc0 = query_tiles(state.acc)
    m0, l0 = (query_tiles(jnp.swapaxes(x, 1, 2)) for x in (state.m, state.l))
    kt, vt = key_tiles(k), key_tiles(v)
    # [nq, B, rows]; padded rows start past every key, so they never lower a tile's first key tile.
    starts = None if kv_start is None else jnp.moveaxis(jnp.pad(
        kv_start, ((0, 0), (0, nq * rows - tq)), constant_values=tk).reshape(batch, nq, rows), 1, 0)
    bcast = (slice(None), None, None, None)  # per-batch scalar -> [B, 1, 1, 1]
    # [nq, B, 1, 1, rows]; padded rows see no key.
    positions = None if q_positions is None else jnp.moveaxis(jnp.pad(
        q_positions, ((0, 0), (0, nq * rows - tq)), constant_values=-1).reshape(batch, nq, 1, 1, rows), 1, 0)

    def query_tile(args):
        qi, acc, m, l, i, start, pos = args
        if pos is None:
            row_pos = q_offset[bcast] + i * rows + jnp.arange(rows, dtype=jnp.int32)  # [B, 1, 1, rows]
        else:
            row_pos = pos
        # Keys [lo, hi) may be visible to some row of this tile; other key tiles are skipped.
        hi = kv_len
        if causal and pos is not None:
            hi = jnp.minimum(hi, jnp.max(pos, axis=(1, 2, 3)) + 1)
        elif causal:
            hi = jnp.minimum(hi, q_offset + jnp.minimum((i + 1) * rows, tq))
        n_tiles = jnp.clip(-(-jnp.max(hi) // _TWIN_KEYS), 0, nk)
        first = 0 if start is None else jnp.clip(jnp.min(start) // _TWIN_KEYS, 0, n_tiles)

        def key_tile(j, carry):
            acc, m, l = carry
            kj = kt[j].reshape(batch, hkv, _TWIN_KEYS, d)
            # Scores in base-2 units, as the kernels keep them: p = 2^(s - m).
            s = jnp.einsum("bhgrd,bhkd->bhgrk", qi, kj, precision=lax.Precision.HIGHEST) * scale_log2
            cols = j * _TWIN_KEYS + jnp.arange(_TWIN_KEYS, dtype=jnp.int32)
            vis = cols < kv_len[bcast][..., None]
            if causal:
                vis = vis & (cols <= row_pos[..., None])
            if start is not None:
                vis = vis & (cols >= start[:, None, None, :, None])
            s = jnp.where(vis, s, NEG_INF).reshape(*s.shape[:-1], per_tile, _GRANULE)
            # The running max after each granule (max is exact, so no rounding depends on tiling).
            m_steps = jnp.maximum(m[..., None], lax.cummax(jnp.max(s, axis=-1), axis=m.ndim))
            m_use = jnp.where(m_steps == NEG_INF, 0.0, m_steps)  # rows with nothing visible yet
            m_before = jnp.concatenate([m[..., None], m_steps[..., :-1]], axis=-1)
            alpha = jnp.exp2(m_before - m_use)
            p = jnp.exp2(s - m_use[..., None])
            p_sum = jnp.sum(p, axis=-1)
            pv = jnp.einsum("bhgrjk,bhjkd->bhgrjd", p, vt[j], precision=lax.Precision.HIGHEST)
            for g in range(per_tile):  # the granules in order, as one call over all keys would take them
                l = l * alpha[..., g] + p_sum[..., g]
                acc = acc * alpha[..., g, None] + pv[..., g, :]
            return acc, m_steps[..., -1], l

        return lax.fori_loop(first, n_tiles, key_tile, (acc, m, l))

    acc, m, l = lax.map(query_tile, (qt, acc0, m0, l0, jnp.arange(nq, dtype=jnp.int32), starts, positions))

    def untile(x):  # inverse of query_tiles
        x = jnp.moveaxis(x, (0, 2, 3), (1, 3, 4))
        return x.reshape(batch, nq * rows, hq, *x.shape[5:])[:, :tq]

    return AttentionState(untile(acc), jnp.swapaxes(untile(m), 1, 2), jnp.swapaxes(untile(l), 1, 2))


def attention_state_xla(q: jax.Array, k: jax.Array, v: jax.Array, state: AttentionState | None = None, *,
                        causal: bool = False, q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
                        kv_start: jax.Array | None = None, q_positions: jax.Array | None = None,
                        sm_scale: float | None = None) -> AttentionState:
    """Continues `state` (None: no key seen yet) over the keys k, v: the jnp twin's resumable form.

    Same arguments and visibility as `attention_with_lse`; keys of this call sit at positions 0..Tk-1,
    so callers streaming blocks pass `q_offset` relative to the block (causal) or causal=False for
    blocks wholly before the queries. Calls over consecutive key blocks whose sizes are multiples of
    16, made in ascending order, give the same bits as one call over all the keys.
    """
    batch, tq, hq, tk, hkv, d = check_attention_shapes(q, k, v, 4)
    if state is None:
        state = empty_state(batch, tq, hq, d)
    check_state(state, batch, tq, hq, d)
    q_offset = per_batch(q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    return _attention_state_xla(q, k, v, state, q_offset, kv_len, per_row(q_positions, batch, tq, "q_positions"),
                                per_row(kv_start, batch, tq),
                                causal=bool(causal), scale_log2=check_sm_scale(sm_scale, d) * LOG2E)


def attention_with_lse_xla(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                           q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
                           kv_start: jax.Array | None = None, q_positions: jax.Array | None = None,
                           sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
                           state: AttentionState | None = None,
                           interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """jnp twin of `attention_with_lse` (same arguments and results; `interpret` is ignored).

    Softmax statistics are float32 and dots use Precision.HIGHEST, so the result is exact to
    float32 rounding. GQA reshapes q to [B, Hkv, G, T, D] instead of repeating KV. Work runs in
    128-row x 128-key tiles with an online softmax taken 16 keys at a time, skipping key tiles no
    row of a query tile sees (see `attention_state_xla`).
    """
    del interpret
    out_dtype = check_out_dtype(out_dtype, q.dtype)
    o, lse = finish_state(attention_state_xla(q, k, v, state, causal=causal, q_offset=q_offset,
                                              kv_len=kv_len, kv_start=kv_start, q_positions=q_positions,
                                              sm_scale=sm_scale))
    return o.astype(out_dtype), lse
