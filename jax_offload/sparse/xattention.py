"""XAttention (Xu et al., 2025) for prefill: per head and query block, the fewest key blocks whose estimated
softmax mass reaches a threshold, found from strided antidiagonal scores (`pallas_kernels.xattn_estimate`), then
attention that visits only those blocks (`pallas_kernels.block_sparse_attention_with_lse`). Key block 0 (the
sink) and the diagonal block are always kept. A threshold of 1 keeps every visible block: full attention.

Blocks are `block` tokens of queries and keys, counted from position 0. Query blocks made only of padding
attend nothing (their rows are never used).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jax_offload.config import XATTN_DEFAULTS, EngineConfig

# Bytes of float32 antidiagonal scores one estimate call may hold; longer prompts are estimated in query chunks.
SCORE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class XAttention:
    # Softmax mass each query block's selected key blocks must reach (the engine's default).
    threshold: float = XATTN_DEFAULTS["xattn_threshold"]
    stride: int = 8  # antidiagonal stride of the estimate
    block: int = 128  # tokens per selection block (queries and keys)
    top_fraction: float | None = None  # instead of the threshold: this fraction of each row's visible blocks


def policy_of(engine: EngineConfig) -> XAttention | None:
    """The XAttention prefill policy of a validated engine config, or None for full prefill."""
    if engine.prefill_policy != "xattention":
        return None
    if engine.xattn_density is not None:
        return XAttention(stride=engine.xattn_stride, block=engine.xattn_block, top_fraction=engine.xattn_density)
    return XAttention(engine.xattn_threshold, engine.xattn_stride, engine.xattn_block)


def visible_blocks(nqb: int, nkb: int, q_offset: int | jax.Array, kv_len: int | jax.Array, block: int) -> jax.Array:
    """bool [nqb, nkb]: key blocks that some real row (position < kv_len) of each query block can see, for
    query block i holding positions q_offset + i * block + [0, block)."""
    first_row = q_offset + jnp.arange(nqb, dtype=jnp.int32) * block
    key_start = jnp.arange(nkb, dtype=jnp.int32) * block
    return (key_start[None, :] <= first_row[:, None] + block - 1) & (key_start[None, :] < kv_len) & (
        first_row[:, None] < kv_len)


def _query_chunk(policy: XAttention, num_heads: int, num_keys: int) -> int:
    """Query rows per estimate call, a multiple of the block, so the scores stay under SCORE_BYTES."""
    per_row = num_heads * math.ceil(num_keys / policy.stride) * 4 / policy.stride
    return max(policy.block, int(SCORE_BYTES / per_row) // policy.block * policy.block)


def select(policy: XAttention, impl: str, q: jax.Array, k: jax.Array, *, q_offset: int | jax.Array,
           kv_len: int | jax.Array) -> jax.Array:
    """bool [1, Hq, nqb, nkb]: the key blocks each head's query blocks attend. q [1, T, Hq, D] holds positions
    q_offset..; keys k [1, S, Hkv, D] positions 0.., those >= kv_len hidden."""
    b, nqb, nkb = policy.block, -(-q.shape[1] // policy.block), -(-k.shape[1] // policy.block)
    vis = visible_blocks(nqb, nkb, q_offset, kv_len, b)
    if policy.top_fraction is None and policy.threshold >= 1.0:
        return jnp.broadcast_to(vis, (1, q.shape[2], nqb, nkb))
    rows = _query_chunk(policy, q.shape[2], k.shape[1])
    parts = []
    for start in range(0, q.shape[1], rows):
        sums, mask = pallas_kernels.xattn_estimate(
            q[:, start:start + rows], k, block_size=b, stride=policy.stride, threshold=policy.threshold, causal=True,
            q_offset=q_offset + start, kv_len=kv_len, impl="pallas" if impl == "pallas" else "xla")
        if policy.top_fraction is not None:
            mask = _top_fraction(sums, vis[start // b:(start + rows) // b], policy.top_fraction, q_offset + start, b)
        parts.append(mask)
    return (jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]) & vis


def _top_fraction(sums: jax.Array, vis: jax.Array, fraction: float, q_offset, block: int) -> jax.Array:
    """Sink, diagonal, and the estimated-heaviest others up to ceil(fraction x visible) blocks per row."""
    nqb, nkb = vis.shape
    kb = jnp.arange(nkb, dtype=jnp.int32)
    diag = (q_offset + jnp.arange(nqb, dtype=jnp.int32) * block) // block
    forced = ((kb[None, :] == 0) | (kb[None, :] == diag[:, None])) & vis
    want = jnp.ceil(fraction * jnp.sum(vis, axis=-1)).astype(jnp.int32) - jnp.sum(forced, axis=-1)  # [nqb]
    score = jnp.where(vis & ~forced, sums, -1.0)
    return forced | (highest_first(score, want) & vis & ~forced)


def highest_first(score: jax.Array, count: jax.Array) -> jax.Array:
    """bool [..., n]: the `count` [...] largest of each row of float32 `score` [..., n] (ties to the lower index):
    what the ranks of a stable descending sort below `count` mark, without sorting. The count-th largest value is
    found bit by bit (32 counting passes over the row's order-preserving unsigned keys); of the values equal to it,
    the first ones by index fill the count. (Two sorts of a 1M-token prefix's [Hq, 128, 8192] block sums were part of
    each 16K chunk's estimate.)"""
    score = score.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(score == 0, 0.0, score), jnp.uint32)  # -0.0 ties with 0.0
    negative = (bits >> 31) == 1
    keys = jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))  # unsigned order == float order
    count = count[..., None]
    threshold = jnp.zeros_like(keys[..., :1])
    for bit in range(31, -1, -1):
        candidate = threshold | jnp.uint32(1 << bit)
        threshold = jnp.where(jnp.sum(keys >= candidate, axis=-1, keepdims=True, dtype=jnp.int32) >= count,
                              candidate, threshold)
    above = keys > threshold
    tie = keys == threshold
    ties_before = jnp.cumsum(tie, axis=-1, dtype=jnp.int32) - tie
    return above | (tie & (ties_before < count - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)))


def block_counts(mask: jax.Array, q_offset: int | jax.Array, kv_len: int | jax.Array, block: int) -> jax.Array:
    """int32 [2]: selected and causally visible (query block, key block) pairs, all heads; their ratio is the
    density of the selection."""
    vis = visible_blocks(mask.shape[2], mask.shape[3], q_offset, kv_len, block)
    return jnp.stack([jnp.sum(mask & vis, dtype=jnp.int32), jnp.sum(vis, dtype=jnp.int32) * mask.shape[1]])


def density(layer_counts: list[jax.Array]) -> list[float]:
    """Per layer, the share of causally visible key blocks a prefill selected, from each layer's
    [selected, visible] (`block_counts`, summed over the prompt's chunks)."""
    counts = np.asarray(jax.device_get(jnp.stack(layer_counts)), np.float64)
    return list(counts[:, 0] / np.maximum(counts[:, 1], 1))


def attention(policy: XAttention, impl: str, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
              causal: bool, q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
              out_dtype: jnp.dtype | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of q over the key blocks `mask` [1, Hq, nqb, nkb] lists: (o, natural-log lse) like
    `attention_with_lse`."""
    blocks, counts = pallas_kernels.mask_to_block_lists(mask)
    fn = (pallas_kernels.block_sparse_attention_with_lse if impl == "pallas"
          else pallas_kernels.block_sparse_attention_with_lse_xla)
    return fn(q, k, v, blocks, counts, block_size=policy.block, causal=causal, q_offset=q_offset, kv_len=kv_len,
              out_dtype=out_dtype)
