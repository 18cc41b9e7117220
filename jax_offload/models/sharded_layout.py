"""Which rows of a Hugging Face checkpoint each tensor-parallel shard holds, in the fused layout the decoder reads.

`wqkv` is laid out as `size` consecutive column groups, group g = [q_g | k_g | v_g]: shard g's query heads and the
KV heads they read, so a contiguous split of the output axis gives every device whole KV-head groups. `w_gate_up`
likewise is `size` groups [gate_g | up_g] of matching halves. With one shard both are today's [q | k | v] and
[gate | up]. When there are fewer KV heads than shards, shard g reads KV head g // (size / Hkv): each KV head is
repeated on the shards whose query heads read it.
"""
from __future__ import annotations

from jax_offload.config import ModelConfig

Rows = tuple[int, int]  # [start, stop) of a tensor's output rows in Hugging Face's [out, in] layout


def qkv_rows(cfg: ModelConfig, size: int, shard: int) -> tuple[Rows, Rows, Rows]:
    """Rows of q_proj, k_proj and v_proj (weights and biases) that shard `shard` of `size` holds; `cfg` is the
    checkpoint's own config."""
    d = cfg.head_dim
    q_heads = cfg.num_heads // size
    if cfg.num_kv_heads >= size:
        kv_heads, first_kv = cfg.num_kv_heads // size, shard * (cfg.num_kv_heads // size)
    else:
        kv_heads, first_kv = 1, shard // (size // cfg.num_kv_heads)
    kv = (first_kv * d, (first_kv + kv_heads) * d)
    return (shard * q_heads * d, (shard + 1) * q_heads * d), kv, kv


def attention_output_rows(cfg: ModelConfig, size: int, shard: int) -> Rows:
    """Rows of `wo` ([Hq * D, hidden]; columns of o_proj) of the shard's query heads."""
    width = cfg.num_heads * cfg.head_dim // size
    return shard * width, (shard + 1) * width


def mlp_rows(cfg: ModelConfig, size: int, shard: int) -> Rows:
    """Rows of gate_proj and up_proj, and rows of `w_down` (columns of down_proj), of the shard's MLP slice."""
    width = cfg.intermediate_size // size
    return shard * width, (shard + 1) * width
