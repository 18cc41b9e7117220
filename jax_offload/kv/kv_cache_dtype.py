"""How the KV cache is stored: "auto" keeps the model's dtype; "fp8" keeps float8_e4m3fn values with one
power-of-two float32 scale per token, KV head and K|V (vLLM's option name and meaning).

A stored KV array is a pytree: a plain array for "auto", `Fp8KV(values [..., D], scales [..., 1])` for "fp8".
Both leaves share every axis but the last, so code that reshapes, slices, gathers, moves or shards the cache on
those axes treats either form with `jax.tree.map`. A host block streamed over PCIe packs the pair into one uint8
array [..., D + 4] (`pack`), so it crosses as one copy; `dequantize` takes that form too.

Quantization happens once, right after K and V are projected (`round_trip`): from there on every path (the
chunk's own keys, the GPU tail, the host store, the paged pool) holds the same values. A power-of-two scale
makes `values * scale` exact in bfloat16 and float32, so dequantizing (in a kernel's registers or in one pass
over HBM) gives the same bits everywhere, and fp8 offloaded equals fp8 in GPU memory by construction.

Why per token: e4m3 carries an exponent per element, so a scale mostly buys range: one per token keeps each
token's small elements out of the subnormals whatever its magnitude. Why a power of two: it makes re-encoding
the rounded values find the same codes (the layer rounds, the stores encode later) and every dequantization
exact. Its price: the largest element lands anywhere in [224, 448] rather than on 448. On the real default model
(float32, CPU, 16 NIAH prompts of 1K and 2K, last 64 logits against the unrounded cache;
`bench/probes/probe_fp8_scales.cpu.json`) an exact per-token scale moved the logits less than this one (mean
|d| 0.25 / 0.27 against 0.33 / 0.41, top-1 agreement 98.0 / 97.5% against 95.7 / 97.1%); scale 1 (no scaling)
and per-channel key scales did no better than this one. In NIAH (8K, 40 prompts per task, H200) the exact scale
scored no better either (31.5 against 32.1, bf16 35.4): e4m3's 3 mantissa bits on the keys are what cost
accuracy, whatever the scale (`bench/results/runs/h200_kv_fp8/README.md`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Fp8KV(NamedTuple):
    values: jax.Array  # float8_e4m3fn [..., D]
    scales: jax.Array  # float32 [..., 1], powers of two


def check_kv_cache_dtype(name: object) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is unknown; valid: {', '.join(KV_CACHE_DTYPES)}.")
    return name


def quantize_fp8(x: jax.Array) -> Fp8KV:
    """x [..., D] -> float8 values and the smallest power-of-two scale per row with max|x| / scale <= 448 (a row of
    zeros gets 2^-9: any scale holds it)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    mantissa, exponent = jnp.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # 448 = 0.875 * 2^9: amax <= 448 * 2^(exponent - 9) exactly when mantissa <= 0.875.
    exponent = exponent - 9 + (mantissa > FP8_MAX / 512).astype(exponent.dtype)
    scales = jnp.ldexp(jnp.ones_like(amax), jnp.clip(exponent, -126, 127))
    return Fp8KV((x.astype(jnp.float32) / scales).astype(FP8), scales)


def values_of(stored) -> jax.Array:
    """The values of a stored KV array in either form (for its shape and dtype)."""
    return stored.values if isinstance(stored, Fp8KV) else stored


def pack(stored: jax.Array | Fp8KV) -> jax.Array:
    """Fp8KV(values [..., D], scales [..., 1]) -> one uint8 array [..., D + 4], each row's value bytes then its
    scale's, so a block crosses PCIe as one copy rather than two; a plain array is returned as it is."""
    if not isinstance(stored, Fp8KV):
        return stored
    values = jax.lax.bitcast_convert_type(stored.values, jnp.uint8)
    scales = jax.lax.bitcast_convert_type(stored.scales[..., 0], jnp.uint8)  # float32 [...] -> uint8 [..., 4]
    return jnp.concatenate([values, scales], axis=-1)


def unpack(stored: jax.Array | Fp8KV) -> jax.Array | Fp8KV:
    """`pack`'s uint8 [..., D + 4] -> Fp8KV(values [..., D], scales [..., 1]), bit for bit; a plain array or an
    Fp8KV is returned as it is."""
    if isinstance(stored, Fp8KV) or stored.dtype != jnp.uint8:
        return stored
    values = jax.lax.bitcast_convert_type(stored[..., :-4], FP8)
    scales = jax.lax.bitcast_convert_type(stored[..., -4:], jnp.float32)[..., None]
    return Fp8KV(values, scales)


def dequantize(stored, dtype) -> jax.Array:
    """A stored KV array (either form, packed or not) -> values in `dtype` (exact for fp8 into bfloat16 or
    float32)."""
    stored = unpack(stored)
    if isinstance(stored, Fp8KV):
        return (stored.values.astype(jnp.float32) * stored.scales).astype(dtype)
    return stored.astype(dtype)


def round_trip(kv_cache_dtype: str, x: jax.Array) -> jax.Array:
    """The values x takes once stored in the cache, in x's dtype."""
    return x if kv_cache_dtype == "auto" else dequantize(quantize_fp8(x), x.dtype)


def encode(kv_cache_dtype: str, x: jax.Array, dtype) -> jax.Array | Fp8KV:
    """x [..., D] as the cache stores it ("auto": cast to `dtype`, the model's)."""
    return x.astype(dtype) if kv_cache_dtype == "auto" else quantize_fp8(x)


def empty(kv_cache_dtype: str, shape: tuple[int, ...], dtype, make=jnp.zeros) -> jax.Array | Fp8KV:
    """A zero-filled stored KV array of `shape` [..., D]; `make(shape, dtype)` allocates each leaf (e.g. on a
    mesh)."""
    if kv_cache_dtype == "auto":
        return make(shape, dtype)
    return Fp8KV(make(shape, FP8), make((*shape[:-1], 1), jnp.float32))


def bytes_per_vector(kv_cache_dtype: str, head_dim: int, dtype) -> int:
    """Bytes one stored vector of head_dim elements (one token's K or V of one KV head) takes."""
    if kv_cache_dtype == "auto":
        return head_dim * jnp.dtype(dtype).itemsize
    return head_dim + 4
