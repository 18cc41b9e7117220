"""Parameter pytrees of the decoder (Flax struct dataclasses, so they pass straight through `jax.jit`)."""
from __future__ import annotations

import jax
from flax import struct

from jax_offload.tensor_parallel import TensorParallel


@struct.dataclass
class LayerParams:
    """One decoder layer; matrices are stored [in, out] so that `x @ w` applies them."""

    attn_norm: jax.Array  # [hidden]
    wqkv: jax.Array  # [hidden, (num_heads + 2 * num_kv_heads) * head_dim], q|k|v fused
    bqkv: jax.Array | None  # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2)
    q_norm: jax.Array | None  # [head_dim] (Qwen3)
    k_norm: jax.Array | None  # [head_dim] (Qwen3)
    wo: jax.Array  # [num_heads * head_dim, hidden]
    mlp_norm: jax.Array  # [hidden]
    w_gate_up: jax.Array  # [hidden, 2 * intermediate], gate|up fused
    w_down: jax.Array  # [intermediate, hidden]
    # wqkv and w_gate_up hold this many column groups, one per tensor-parallel device: [q_g|k_g|v_g] and
    # [gate_g|up_g] (`sharded_layout`); 1 is the plain [q|k|v], [gate|up]. Static: it shapes the trace.
    num_shards: int = struct.field(pytree_node=False, default=1)
    # Multiply by the batch-invariant Pallas matmul (a row's bits independent of the other rows); else XLA's dot.
    batch_invariant: bool = struct.field(pytree_node=False, default=False)
    # The mesh the weights are split over when batch_invariant runs the matmul on each device's shard (None: one
    # device); XLA splits its own dot.
    tp: TensorParallel | None = struct.field(pytree_node=False, default=None)
    # How the KV cache stores K and V (`kv.kv_cache_dtype`): the layer rounds them to the stored values once, as
    # it projects them, so every attention path reads the same keys.
    kv_cache_dtype: str = struct.field(pytree_node=False, default="auto")
    # The batch-invariant matmul's order for the tokens this layer view multiplies: all of K in one pass (a prompt's
    # tokens, `for_prompt_tokens`) or in 1,024-key chunks (generated tokens; `pallas_kernels.matmul`).
    k_one_pass: bool = struct.field(pytree_node=False, default=False)

    def for_prompt_tokens(self) -> "LayerParams":
        """The same layer, its batch-invariant matmuls summing K in one pass: how every path (prefill in GPU memory
        or offloaded, in chunks, packed, beside decode tokens) multiplies a prompt's tokens."""
        return self.replace(k_one_pass=True)


@struct.dataclass
class ModelParams:
    embed: jax.Array  # [vocab, hidden]
    layers: list[LayerParams]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to `embed`
    batch_invariant: bool = struct.field(pytree_node=False, default=False)  # as LayerParams'; also decode attention
    tp: TensorParallel | None = struct.field(pytree_node=False, default=None)  # as LayerParams'
    kv_cache_dtype: str = struct.field(pytree_node=False, default="auto")  # as LayerParams'; also the KV pool's

    def with_batch_invariance(self, on: bool, tp: TensorParallel | None = None) -> "ModelParams":
        """The same weights, multiplied (and decode attention reduced) batch-invariantly or not; `tp`: the mesh they
        are split over (the matmul then runs on each device's shard)."""
        tp = tp if on and tp is not None and tp.size > 1 else None
        return self.replace(layers=[layer.replace(batch_invariant=on, tp=tp) for layer in self.layers],
                            batch_invariant=on, tp=tp)

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> "ModelParams":
        """The same weights, with K and V rounded to what a `kv_cache_dtype` cache stores."""
        return self.replace(layers=[layer.replace(kv_cache_dtype=kv_cache_dtype) for layer in self.layers],
                            kv_cache_dtype=kv_cache_dtype)
