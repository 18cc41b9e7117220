"""Scores of every token of a low-bit key sketch against a query group (sketch decode's page choice).

`sketch_scores` launches one program per (token block, KV head): it loads the block's codes (int4, two per byte,
or int8), unpacks them in registers into exact small integers of q's dtype, multiplies them with the KV head's
query group on the tensor cores and scales each token's column by its float32 scale: float32 [Hkv, G, T] of
(q . codes) * scale * sm_scale. The codes never exist unpacked in memory, so the kernel reads the sketch once.

int4 layout (`jax_offload.sparse.sketch.pack_codes`): byte j of a token holds channel j in its low nibble and
channel j + D / 2 in its high nibble, each offset by 8, so the two halves of q meet the two nibbles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    MIN_BLOCK,
    check_sm_scale,
    compiler_params,
    dot_precision,
    fit_block,
    interpret_aware_jit,
    load_rows,
    next_pow2,
    resolve_interpret,
)

SKETCH_BITS = (4, 8)


def _sketch_kernel(q_ref, codes_ref, scale_ref, o_ref, *, block_t: int, group: int, num_tokens: int, bits: int,
                   sm_scale: float, precision):
    start = pl.multiple_of(pl.program_id(0) * block_t, block_t)
    tokens = pl.ds(start, block_t)
    # Masks only where the last block is ragged: unmasked loads vectorize best.
    ragged = num_tokens % block_t != 0
    col_ok = start + jnp.arange(block_t, dtype=jnp.int32) < num_tokens if ragged else None
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    dtype = q_ref.dtype
    codes = load_rows(codes_ref, tokens, col_ok)
    if bits == 4:
        half = codes_ref.shape[-1]
        packed = codes.astype(jnp.int32)
        lo, hi = ((packed & 15) - 8).astype(dtype), ((packed >> 4) - 8).astype(dtype)
        q_lo = plgpu.load(q_ref.at[:, pl.ds(0, half)], mask=row_ok[:, None], other=0)
        q_hi = plgpu.load(q_ref.at[:, pl.ds(half, half)], mask=row_ok[:, None], other=0)
        s = (plgpu.dot(q_lo, lo, trans_b=True, precision=precision)
             + plgpu.dot(q_hi, hi, trans_b=True, precision=precision))
    else:
        q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)
        s = plgpu.dot(q, codes.astype(dtype), trans_b=True, precision=precision)
    if ragged:
        scale = plgpu.load(scale_ref.at[tokens], mask=col_ok, other=0.0)
        mask = row_ok[:, None] & col_ok[None, :]
    else:
        scale, mask = plgpu.load(scale_ref.at[tokens]), row_ok[:, None]
    plgpu.store(o_ref.at[:, tokens], s * (scale * sm_scale)[None, :], mask=mask)


def _sketch_call(q, codes, scale, *, bits, sm_scale, interpret, block_t, num_warps, num_stages):
    hkv, group, d = q.shape
    t, width = codes.shape[1], codes.shape[2]
    block_h = max(MIN_BLOCK, next_pow2(group))
    kernel = functools.partial(_sketch_kernel, block_t=block_t, group=group, num_tokens=t, bits=bits,
                               sm_scale=sm_scale, precision=dot_precision(q.dtype))
    return pl.pallas_call(
        kernel,
        grid=(-(-t // block_t), hkv),
        in_specs=[
            # The query block is padded past the group to a full tensor-core tile.
            pl.BlockSpec((None, block_h, d), lambda i, h: (h, 0, 0)),
            pl.BlockSpec((None, t, width), lambda i, h: (h, 0, 0)),
            pl.BlockSpec((None, t), lambda i, h: (h, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_h, t), lambda i, h: (h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((hkv, group, t), jnp.float32),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="sketch_scores",
    )(q, codes, scale)


_sketch_call = interpret_aware_jit(
    _sketch_call, ("bits", "sm_scale", "interpret", "block_t", "num_warps", "num_stages"))


def sketch_scores(q: jax.Array, codes: jax.Array, scale: jax.Array, *, bits: int, sm_scale: float | None = None,
                  interpret: bool | None = None, block_t: int = 256, num_warps: int = 8,
                  num_stages: int = 2) -> jax.Array:
    """Estimated attention logits of every sketched token.

    Args:
      q: [Hkv, G, D] query heads grouped by their KV head (bfloat16, float16 or float32).
      codes: bits=4: uint8 [Hkv, T, D / 2] (two codes a byte, see the module docstring); bits=8: int8 [Hkv, T, D].
      scale: float32 [Hkv, T], each token's scale.
      sm_scale: default 1/sqrt(D). block_t: tokens per program (power of two >= 16).

    Returns:
      float32 [Hkv, G, T]: (q . codes) * scale * sm_scale.
    """
    if bits not in SKETCH_BITS:
        raise ValueError(f"bits={bits}; allowed: {', '.join(map(str, SKETCH_BITS))}")
    if q.ndim != 3 or codes.ndim != 3 or codes.shape[0] != q.shape[0]:
        raise ValueError(f"q has shape {q.shape} and codes {codes.shape}; allowed: [Hkv, G, D] and [Hkv, T, width]")
    hkv, _, d = q.shape
    t = codes.shape[1]
    width, code_dtype = (d // 2, jnp.uint8) if bits == 4 else (d, jnp.int8)
    if codes.shape[2] != width or codes.dtype != code_dtype or (bits == 4 and d % 2):
        raise ValueError(f"codes have shape {codes.shape} and dtype {codes.dtype}; allowed for bits={bits} and head "
                         f"dim {d}: [{hkv}, T, {width}] {jnp.dtype(code_dtype).name}")
    if scale.shape != (hkv, t):
        raise ValueError(f"scale has shape {scale.shape}; allowed: ({hkv}, {t})")
    return _sketch_call(q, codes, scale.astype(jnp.float32), bits=bits, sm_scale=check_sm_scale(sm_scale, d),
                        interpret=resolve_interpret(interpret), block_t=fit_block(block_t, t),
                        num_warps=num_warps, num_stages=num_stages)
