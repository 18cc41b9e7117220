"""Which attention implementation runs, and the jit-compiled layer steps for a KV cache in GPU memory.

On a GPU the Pallas (Triton) kernels run; elsewhere their plain-XLA twins with identical semantics, because
Pallas interpret mode is an emulator meant for checking kernels, far too slow for whole models.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from jax_offload.config import ModelConfig
from jax_offload.models import decoder
from jax_offload.models.params import LayerParams

ATTENTION_IMPLS = ("pallas", "xla")


def default_attention_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def check_attention_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is unknown; valid: {', '.join(ATTENTION_IMPLS)}.")
    return impl


def prefill_attention(impl: str, q, k, v, *, causal: bool, q_offset=0, kv_len=None):
    """Attention with LSE of a query chunk [B, T, Hq, D] over keys [B, S, Hkv, D]."""
    fn = pallas_kernels.attention_with_lse if impl == "pallas" else pallas_kernels.attention_with_lse_xla
    return fn(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len)


def decode_attention(impl: str, q, k, v, *, kv_len=None):
    """Attention with LSE of one query token [B, Hq, D] over keys [B, S, Hkv, D]."""
    fn = pallas_kernels.decode_attention_with_lse if impl == "pallas" else pallas_kernels.decode_attention_with_lse_xla
    return fn(q, k, v, kv_len=kv_len)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5, 6))
def prefill_layer_in_device(
    cfg: ModelConfig,
    impl: str,
    layer: LayerParams,
    x: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    prompt_len: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer over a whole (padded) prompt x [1, T, hidden]; writes its K, V into the caches [1, S, Hkv, D]."""
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, k, v = decoder.attention_inputs(cfg, layer, x, positions, inv_freq)
    o, _ = prefill_attention(impl, q, k, v, causal=True, kv_len=prompt_len)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
    return decoder.attention_output_and_mlp(cfg, layer, x, o), k_cache, v_cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5, 6))
def decode_layer_in_device(
    cfg: ModelConfig,
    impl: str,
    layer: LayerParams,
    x: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    position: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer for one new token x [1, 1, hidden] at `position`; appends its K, V to the caches."""
    q, k, v = decoder.attention_inputs(cfg, layer, x, position.reshape(1, 1), inv_freq)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, position, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, position, 0, 0))
    o, _ = decode_attention(impl, q[:, 0], k_cache, v_cache, kv_len=position + 1)
    return decoder.attention_output_and_mlp(cfg, layer, x, o[:, None]), k_cache, v_cache
