"""How the KV cache is stored: "auto" keeps the model's dtype; "fp8" keeps float8_e4m3fn values (vLLM's option
name and meaning) and "int8" int8 values, each with one power-of-two float32 scale per token, KV head and K|V.

A stored KV array is a pytree: a plain array for "auto", `QuantizedKV(values [..., D], scales [..., 1])` for fp8
and int8. Both leaves share every axis but the last, so code that reshapes, slices, gathers, moves or shards the
cache on those axes treats every form with `jax.tree.map`. A host block streamed over PCIe packs the pair into one
byte array [..., D + 4] (`pack`), so it crosses as one copy; `dequantize` takes that form too.

Quantization happens once, right after K and V are projected (`round_trip`): from there on every path (the
chunk's own keys, the GPU tail, the host store, the paged pool) holds the same values. A power-of-two scale
makes `values * scale` exact in bfloat16 and float32 (e4m3 has 4 significant bits, int8 at most 7, bfloat16 8),
so dequantizing (in a kernel's registers or in one pass over HBM) gives the same bits everywhere, re-encoding the
rounded values finds the same codes (the layer rounds, the stores encode later), and offloaded equals in GPU
memory by construction. Its price: a row's largest element lands in [224, 448] (fp8) or [64, 127] (int8) rather
than on the top.

Which to use (SmolLM2-135M, the eight NIAH tasks, 40 prompts each, H200; `bench/results/runs/h200_kv_fp8/`):
int8's uniform steps keep the few large key elements that carry a logit within 0.4%, where e4m3's 3 mantissa bits
round every element up to 6%; fp8 keys cost 3 points at 8K on this model, and no scale choice (exact, per channel,
a bf16 sink, SageAttention's smoothing, a Hadamard rotation) won them back. Both halve the bytes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
FP8 = jnp.float8_e4m3fn
# Per quantized format: the values' dtype and the largest value a row may reach.
_FORMATS = {"fp8": (FP8, 448.0), "int8": (jnp.int8, 127.0)}


class QuantizedKV(NamedTuple):
    values: jax.Array  # float8_e4m3fn or int8 [..., D]
    scales: jax.Array  # float32 [..., 1], powers of two


def check_kv_cache_dtype(name: object) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is unknown; valid: {', '.join(KV_CACHE_DTYPES)}.")
    return name


def quantize(kv_cache_dtype: str, x: jax.Array) -> QuantizedKV:
    """x [..., D] -> values ("fp8": float8_e4m3fn; "int8": int8, rounded to nearest even) and the smallest
    power-of-two scale per row with max|x| / scale <= 448 (fp8) or 127 (int8). A row of zeros gets 2^-9 / 2^-7:
    any scale holds it."""
    values_dtype, top = _FORMATS[kv_cache_dtype]
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    mantissa, exponent = jnp.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    top_mantissa, top_exponent = math.frexp(top)  # 448 = 0.875 * 2^9, 127 = 0.9921875 * 2^7
    # amax <= top * 2^(exponent - top_exponent) exactly when mantissa <= top_mantissa.
    exponent = exponent - top_exponent + (mantissa > top_mantissa).astype(exponent.dtype)
    scales = jnp.ldexp(jnp.ones_like(amax), jnp.clip(exponent, -126, 127))
    scaled = x.astype(jnp.float32) / scales
    return QuantizedKV((jnp.round(scaled) if values_dtype == jnp.int8 else scaled).astype(values_dtype), scales)


def values_of(stored: jax.Array | QuantizedKV) -> jax.Array:
    """The values of a stored KV array in any form (for its shape and dtype)."""
    return stored.values if isinstance(stored, QuantizedKV) else stored


def pack(stored: jax.Array | QuantizedKV) -> jax.Array:
    """QuantizedKV(values [..., D], scales [..., 1]) -> one byte array [..., D + 4], each row's value bytes then its
    scale's (uint8 for fp8, int8 for int8), so a block crosses PCIe as one copy rather than two; a plain array is
    returned as it is."""
    if not isinstance(stored, QuantizedKV):
        return stored
    carrier = jnp.uint8 if stored.values.dtype == FP8 else jnp.int8
    values = jax.lax.bitcast_convert_type(stored.values, carrier)
    scales = jax.lax.bitcast_convert_type(stored.scales[..., 0], carrier)  # float32 [...] -> [..., 4] bytes
    return jnp.concatenate([values, scales], axis=-1)


def unpack(stored: jax.Array | QuantizedKV) -> jax.Array | QuantizedKV:
    """`pack`'s byte array [..., D + 4] -> QuantizedKV(values [..., D], scales [..., 1]), bit for bit; a plain
    array of the model's dtype or a QuantizedKV is returned as it is."""
    if isinstance(stored, QuantizedKV) or stored.dtype not in (jnp.uint8, jnp.int8):
        return stored
    values = jax.lax.bitcast_convert_type(stored[..., :-4], FP8 if stored.dtype == jnp.uint8 else jnp.int8)
    scales = jax.lax.bitcast_convert_type(stored[..., -4:], jnp.float32)[..., None]
    return QuantizedKV(values, scales)


def dequantize(stored: jax.Array | QuantizedKV, dtype: jnp.dtype) -> jax.Array:
    """A stored KV array (any form, packed or not) -> values in `dtype` (exact for fp8 and int8 into bfloat16 or
    float32)."""
    stored = unpack(stored)
    if isinstance(stored, QuantizedKV):
        return (stored.values.astype(jnp.float32) * stored.scales).astype(dtype)
    return stored.astype(dtype)


def round_trip(kv_cache_dtype: str, x: jax.Array) -> jax.Array:
    """The values x takes once stored in the cache, in x's dtype."""
    return x if kv_cache_dtype == "auto" else dequantize(quantize(kv_cache_dtype, x), x.dtype)


def encode(kv_cache_dtype: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array | QuantizedKV:
    """x [..., D] as the cache stores it ("auto": cast to `dtype`, the model's)."""
    return x.astype(dtype) if kv_cache_dtype == "auto" else quantize(kv_cache_dtype, x)


def empty(kv_cache_dtype: str, shape: tuple[int, ...], dtype: jnp.dtype,
          make: Callable[..., jax.Array] = jnp.zeros) -> jax.Array | QuantizedKV:
    """A zero-filled stored KV array of `shape` [..., D]; `make(shape, dtype)` allocates each leaf (e.g. on a
    mesh)."""
    if kv_cache_dtype == "auto":
        return make(shape, dtype)
    return QuantizedKV(make(shape, _FORMATS[kv_cache_dtype][0]), make((*shape[:-1], 1), jnp.float32))


def bytes_per_vector(kv_cache_dtype: str, head_dim: int, dtype: jnp.dtype) -> int:
    """Bytes one stored vector of head_dim elements (one token's K or V of one KV head) takes."""
    if kv_cache_dtype == "auto":
        return head_dim * jnp.dtype(dtype).itemsize
    return head_dim + 4
