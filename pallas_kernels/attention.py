"""Prefill attention that also returns the log-sum-exp (LSE) of every query row.

`attention_with_lse` is a Pallas kernel (Triton on NVIDIA GPUs, interpreted elsewhere);
`attention_with_lse_xla` is a plain jnp version with the same signature and semantics, used
where interpret mode is too slow (whole models on the CPU).

Semantics shared by both:
  q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]; query head h reads KV head h // (Hq // Hkv).
  Query i sits at absolute position q_offset + i; key j at position j.
  Key j is visible to query i iff j < kv_len and (not causal or j <= q_offset + i).
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

from pallas_kernels._common import (
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
    interpret_aware_jit,
    per_batch,
    resolve_interpret,
)


def default_attention_config(dtype) -> dict[str, int]:
    """Block sizes and launch parameters tuned on an H200 (see bench/bench_kernels.py).

    float32 uses exact (non-tf32) dots, which run on CUDA cores and need smaller tiles.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return dict(block_q=64, block_k=32, num_warps=4, num_stages=2)
    return dict(block_q=128, block_k=64, num_warps=4, num_stages=2)


def _attention_kernel(qoff_ref, kvlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                      causal: bool, scale_log2: float, block_q: int, block_k: int, tq: int,
                      num_q_blocks: int, precision):
    pid = pl.program_id(0)
    # Causal: the last query blocks carry the most work, so launch them first.
    i = (num_q_blocks - 1 - pid) if causal else pid
    row0 = pl.multiple_of(i * block_q, block_q)
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < tq
    q_offset = qoff_ref[()]
    kv_len = kvlen_ref[()]  # already clamped to [0, Tk] by the wrapper

    q = load_rows(q_ref, pl.ds(row0, block_q), row_ok)
    head_dim = q.shape[-1]

    # Keys [0, hi) may be visible to some row of this block; blocks below n_full are visible
    # to every row, so they skip all masking.
    if causal:
        last_row = jnp.minimum(row0 + block_q, tq) - 1
        hi = jnp.clip(q_offset + last_row + 1, 0, kv_len)
        n_full = fdiv(jnp.clip(q_offset + row0 + 1, 0, kv_len), block_k)
    else:
        hi = kv_len
        n_full = fdiv(kv_len, block_k)
    n_blocks = cdiv(hi, block_k)
    n_full = jnp.minimum(n_full, n_blocks)

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
                vis = vis & (cols[None, :] <= (q_offset + rows)[:, None])
            s = jnp.where(vis, s, NEG_INF)
        return online_softmax_update(
            carry, s, lambda: load_rows(v_ref, kslice, col_ok), scale_log2=scale_log2,
            masked=masked, precision=precision)

    carry = empty_softmax_state(block_q, head_dim)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)
    o, lse = finish_online_softmax(*carry)
    plgpu.store(o_ref.at[pl.ds(row0, block_q), :], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(row0, block_q)], lse, mask=row_ok)


def _attention_pallas(q, k, v, q_offset, kv_len, *, causal, sm_scale, out_dtype, interpret,
                      block_q, block_k, num_warps, num_stages):
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    num_q_blocks = -(-tq // block_q)
    kernel = functools.partial(
        _attention_kernel, causal=causal, scale_log2=sm_scale * LOG2E, block_q=block_q,
        block_k=block_k, tq=tq, num_q_blocks=num_q_blocks, precision=dot_precision(q.dtype))
    scalar = pl.BlockSpec((None,), lambda i, bh: (bh // hq,))
    q_spec = pl.BlockSpec((None, tq, None, d), lambda i, bh: (bh // hq, 0, bh % hq, 0))
    kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, bh: (bh // hq, 0, (bh % hq) // group, 0))
    lse_spec = pl.BlockSpec((None, None, tq), lambda i, bh: (bh // hq, bh % hq, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch * hq),
        in_specs=[scalar, scalar, q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, out_dtype),
                   jax.ShapeDtypeStruct((batch, hq, tq), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="attention_with_lse",
    )(q_offset, kv_len, q, k, v)


_attention_pallas = interpret_aware_jit(
    _attention_pallas, ("causal", "sm_scale", "out_dtype", "interpret", "block_q", "block_k",
                        "num_warps", "num_stages"))


def _check_pallas_head_dim(d: int) -> None:
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(
            f"head_dim={d} is not supported by the Pallas kernel; allowed: a power of two in "
            "[16, 256] (use attention_with_lse_xla otherwise)")


def attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                       q_offset=0, kv_len=None, sm_scale: float | None = None,
                       out_dtype=None, interpret: bool | None = None, block_q: int | None = None,
                       block_k: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Flash attention forward with GQA, causal offset, per-batch key length and LSE.

    Args:
      q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq % Hkv == 0 (KV is never repeated).
      causal: query i sees key j only if j <= q_offset + i.
      q_offset: absolute position of query 0; int or int32 array (scalar or [B]); may be traced.
      kv_len: keys j >= kv_len are invisible; int or int32 array (scalar or [B]); may be traced;
        None means Tk. Values are clamped to [0, Tk].
      sm_scale: score scale, default 1/sqrt(D). Static.
      out_dtype: dtype of o, default q.dtype. Static. float32 returns the kernel's float32
        accumulator unrounded, for states that will be merged.
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      block_q, block_k, num_warps, num_stages: launch parameters (powers of two >= 16 for
        blocks); None takes `default_attention_config`.

    Returns:
      o [B, Tq, Hq, D] in out_dtype (default q.dtype) and lse [B, Hq, Tq] float32 (natural log). Rows with no
      visible key give o = 0 and lse = -inf. Key blocks that no row of a query block can see
      are never loaded, so a fully masked call costs only the launch.
    """
    batch, tq, hq, tk, hkv, d = check_attention_shapes(q, k, v, 4)
    _check_pallas_head_dim(d)
    cfg = default_attention_config(q.dtype)
    block_q = fit_block(block_q or cfg["block_q"], tq)
    block_k = fit_block(block_k or cfg["block_k"], tk)
    q_offset = per_batch(q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    return _attention_pallas(
        q, k, v, q_offset, kv_len, causal=bool(causal),
        sm_scale=check_sm_scale(sm_scale, d), out_dtype=check_out_dtype(out_dtype, q.dtype),
        interpret=resolve_interpret(interpret), block_q=block_q, block_k=block_k,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])


# The jnp path works on [query block x key block] tiles so scores stay in cache and causal work
# stops at the diagonal (on a CPU this is ~9x faster than materialising every score at 4K).
_XLA_BLOCK_Q = 512
_XLA_BLOCK_K = 512


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "out_dtype", "block_q", "block_k"))
def _attention_xla(q, k, v, q_offset, kv_len, *, causal, sm_scale, out_dtype, block_q, block_k):
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    nq, nk = -(-tq // block_q), -(-tk // block_k)
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, nq * block_q - tq), (0, 0), (0, 0)))
    # [nq, B, Hkv, G, block_q, D]: one query block per map step, GQA without repeating KV.
    qf = qf.reshape(batch, nq, block_q, hkv, group, d).transpose(1, 0, 3, 4, 2, 5)

    def key_blocks(x):  # [nk, B, Hkv, block_k, D]; padded keys sit past kv_len <= Tk
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nk * block_k - tk), (0, 0), (0, 0)))
        return x.reshape(batch, nk, block_k, hkv, d).transpose(1, 0, 3, 2, 4)

    kb, vb = key_blocks(k), key_blocks(v)
    bcast = (slice(None), None, None, None)  # per-batch scalar -> [B, 1, 1, 1]

    def query_block(args):
        qi, i = args
        rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
        # Keys [0, hi) may be visible to some row of this block; later key blocks are skipped.
        hi = kv_len
        if causal:
            hi = jnp.minimum(hi, q_offset + jnp.minimum((i + 1) * block_q, tq))
        n_blocks = jnp.clip(-(-jnp.max(hi) // block_k), 0, nk)

        def key_block(j, carry):
            acc, m, l = carry
            cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
            s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kb[j], precision=lax.Precision.HIGHEST) * sm_scale
            vis = cols[None, None, None, None, :] < kv_len[bcast][..., None]
            if causal:
                vis = vis & (cols[None, :] <= (q_offset[bcast] + rows)[..., None])
            s = jnp.where(vis, s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p, vb[j], precision=lax.Precision.HIGHEST)
            return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

        init = (jnp.zeros((batch, hkv, group, block_q, d), jnp.float32),
                jnp.full((batch, hkv, group, block_q), NEG_INF, jnp.float32),
                jnp.zeros((batch, hkv, group, block_q), jnp.float32))
        acc, m, l = lax.fori_loop(0, n_blocks, key_block, init)
        seen = l > 0.0
        l_safe = jnp.where(seen, l, 1.0)
        lse = jnp.where(seen, m + jnp.log(l_safe), NEG_INF)
        return acc / l_safe[..., None], lse  # unseen rows have acc = 0, so o = 0

    o, lse = lax.map(query_block, (qf, jnp.arange(nq, dtype=jnp.int32)))
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(batch, nq * block_q, hq, d)[:, :tq]
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(batch, hq, nq * block_q)[..., :tq]
    return o.astype(out_dtype), lse


def attention_with_lse_xla(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                           q_offset=0, kv_len=None, sm_scale: float | None = None,
                           out_dtype=None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """jnp twin of `attention_with_lse` (same arguments and results; `interpret` is ignored).

    Softmax statistics are float32 and dots use Precision.HIGHEST, so the result is exact to
    float32 rounding. GQA reshapes q to [B, Hkv, G, Tq, D] instead of repeating KV. Work runs
    in 512 x 512 tiles with an online softmax, skipping key tiles no row of a query tile sees.
    """
    del interpret
    batch, tq, hq, tk, hkv, d = check_attention_shapes(q, k, v, 4)
    q_offset = per_batch(q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    return _attention_xla(
        q, k, v, q_offset, kv_len, causal=bool(causal), sm_scale=check_sm_scale(sm_scale, d),
        out_dtype=check_out_dtype(out_dtype, q.dtype), block_q=min(_XLA_BLOCK_Q, tq), block_k=min(_XLA_BLOCK_K, tk))
