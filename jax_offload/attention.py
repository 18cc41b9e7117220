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


@jax.jit
def embed_tokens(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """token_ids [B, T] -> hidden [B, T, hidden] (takes the table alone: cheaper to pass than all params)."""
    return jnp.take(table, token_ids, axis=0)


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


# ---- offloaded KV: a query chunk or token attends block by block, states merged in float32 ----------


def _split_block(block: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A stored block [2, block_size, Hkv, D] -> k, v [1, block_size, Hkv, D]."""
    return block[0][None], block[1][None]


def _join_blocks(blocks: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """Consecutive blocks -> k, v [1, n * block_size, Hkv, D]: one kernel call covers the whole group."""
    return _split_block(jnp.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0])


@functools.partial(jax.jit, static_argnums=(0, 1))
def chunk_begin(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, start: jax.Array, chunk_len: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """q of a prompt chunk x [1, T, hidden] at absolute `start`, its KV block [2, T, Hkv, D], and the
    float32 state (o, lse) of its causal attention on itself."""
    positions = start + jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, k, v = decoder.attention_inputs(cfg, layer, x, positions, inv_freq)
    o, lse = prefill_attention(impl, q, k, v, causal=True, kv_len=chunk_len)
    return q, jnp.stack([k[0], v[0]]), o.astype(jnp.float32), lse


@functools.partial(jax.jit, static_argnums=(0,))
def chunk_attend_blocks(
    impl: str, q: jax.Array, blocks: tuple[jax.Array, ...], o_acc: jax.Array, lse_acc: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merges the attention of a chunk's queries over earlier (wholly visible) blocks into the state."""
    k, v = _join_blocks(blocks)
    o, lse = prefill_attention(impl, q, k, v, causal=False)
    return pallas_kernels.merge_states(o_acc, lse_acc, o.astype(jnp.float32), lse)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5,))
def decode_begin(
    cfg: ModelConfig,
    impl: str,
    layer: LayerParams,
    x: jax.Array,
    inv_freq: jax.Array,
    tail: jax.Array,
    position: jax.Array,
    tail_len: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For a new token x [1, 1, hidden]: q [1, Hq, D], the GPU tail block [2, block_size, Hkv, D] with the
    token's K, V appended at `tail_len`, and the float32 state of attention over the tail."""
    q, k, v = decoder.attention_inputs(cfg, layer, x, position.reshape(1, 1), inv_freq)
    tail = jax.lax.dynamic_update_slice(tail, jnp.stack([k[0], v[0]]).astype(tail.dtype), (0, tail_len, 0, 0))
    tk, tv = _split_block(tail)
    o, lse = decode_attention(impl, q[:, 0], tk, tv, kv_len=tail_len + 1)
    return q[:, 0], tail, o.astype(jnp.float32), lse


@functools.partial(jax.jit, static_argnums=(0,))
def decode_attend_blocks(
    impl: str, q: jax.Array, blocks: tuple[jax.Array, ...], o_acc: jax.Array, lse_acc: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merges one token's attention over host blocks into its state (o [1, Hq, D], lse [1, Hq])."""
    k, v = _join_blocks(blocks)
    o, lse = decode_attention(impl, q, k, v)
    merged_o, merged_lse = pallas_kernels.merge_states(
        o_acc[:, None], lse_acc[..., None], o[:, None].astype(jnp.float32), lse[..., None]
    )
    return merged_o[:, 0], merged_lse[..., 0]


@functools.partial(jax.jit, static_argnums=(0,))
def finish_layer(cfg: ModelConfig, layer: LayerParams, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The rest of a layer once attention is merged; attn is rounded to the model dtype here, once."""
    if attn.ndim == 3:
        attn = attn[:, None]
    return decoder.attention_output_and_mlp(cfg, layer, x, attn)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def layerwise_layer(
    cfg: ModelConfig, impl: str, block_size: int, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, prompt_len: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One layer over the whole prompt x [1, T, hidden] (T a multiple of block_size); its KV as blocks."""
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, k, v = decoder.attention_inputs(cfg, layer, x, positions, inv_freq)
    o, _ = prefill_attention(impl, q, k, v, causal=True, kv_len=prompt_len)
    kv = jnp.stack([k[0], v[0]])
    blocks = tuple(kv[:, i : i + block_size] for i in range(0, x.shape[1], block_size))
    return decoder.attention_output_and_mlp(cfg, layer, x, o), blocks
