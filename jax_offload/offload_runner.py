"""Runs the model with the KV cache in pinned host memory, streamed back through the GPU ring.

Per request the state is: full blocks in the host store (`store.num_written`) and one partial block per
layer on the GPU (the tail) holding the tokens not yet flushed. `finish` clears both, always.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.attention import (
    attend_blocks,
    chunk_begin,
    chunk_end,
    decode_begin,
    decode_end,
    embed_tokens,
    layerwise_layer,
)
from jax_offload.buckets import prompt_bucket
from jax_offload.config import EngineConfig, ModelConfig, round_up
from jax_offload.kv.host_store import HostKVStore
from jax_offload.kv.ring import BlockRing, Key, group_size, grouped
from jax_offload.models.params import ModelParams
from jax_offload.progress import LaggedProgress
from jax_offload.sparse import SparsePolicy


class OffloadRunner:
    """The request's KV in the pinned-host store; attention streams it back group by group through the ring."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: ModelParams,
        inv_freq: jax.Array,
        dtype: jnp.dtype,
        impl: str,
        engine: EngineConfig,
        policy: SparsePolicy,
    ):
        self.cfg, self.params, self.inv_freq, self.dtype, self.impl = cfg, params, inv_freq, dtype, impl
        self.block_size, self.num_slots, self.mode, self.policy = (
            engine.block_size,
            engine.num_ring_slots,
            engine.prefill,
            policy,
        )
        self.group = group_size(engine.num_ring_slots)
        self.store = HostKVStore(
            cfg.num_layers,
            -(-engine.max_model_len // engine.block_size),
            engine.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            jax.devices()[0],
        )
        self._tails: list[jax.Array | None] = []
        self._tail_len = 0

    def padded_length(self, prompt_len: int) -> int:
        if self.mode == "chunked":
            return round_up(prompt_len, self.block_size)
        return round_up(prompt_bucket(prompt_len), self.block_size)

    def _empty_tail(self) -> jax.Array:
        return jnp.zeros((2, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim), self.dtype)

    # ---- streaming host blocks ---------------------------------------------------------------

    def _stream(self, blocks_per_layer: list[Sequence[int]]) -> tuple[list[list[list[Key]]], BlockRing]:
        """Per layer, its blocks in groups of `self.group`, and a ring that streams every group in that order."""
        groups = [grouped([(l, b) for b in blocks], self.group) for l, blocks in enumerate(blocks_per_layer)]
        return groups, BlockRing(self.store, self.num_slots, (g for layer_groups in groups for g in layer_groups))

    def _attend_groups(self, ring: BlockRing, layer_groups: list[list[Key]], q, state):
        """Continues the attention state over each of the layer's groups, handing each group's slots back."""
        for g in layer_groups:
            state = attend_blocks(self.impl, q, tuple(ring.take()), state)
            ring.release(state.m, len(g))
        return state

    # ---- prefill -------------------------------------------------------------------------------

    def prefill(
        self,
        ids: np.ndarray,
        prompt_len: int,
        total_len: int,
        progress: Callable[[float], None] | None = None,
        keep_all: bool = False,
    ) -> tuple[jax.Array, int]:
        """ids [1, T] prompt padded by `padded_length` -> (final hidden states [1, T', hidden], position of
        their first row). Chunked prefill keeps only the last chunk's rows unless `keep_all`, so GPU memory
        does not grow with the prompt. `progress(tokens)` is told how much is done as work completes."""
        self.store.reset()
        self._tails = [None] * self.cfg.num_layers
        if self.mode == "chunked":
            out = self._prefill_chunked(ids, prompt_len, progress, keep_all)
        else:
            out = self._prefill_layerwise(embed_tokens(self.params.embed, ids), prompt_len, progress), 0
        self._tail_len = prompt_len % self.block_size
        self._tails = [self._empty_tail() if t is None else t for t in self._tails]
        return out

    def _prefill_chunked(self, ids: np.ndarray, prompt_len: int, progress, keep_all: bool) -> tuple[jax.Array, int]:
        bs, layers = self.block_size, self.params.layers
        outputs = []
        num_chunks = ids.shape[1] // bs
        done = LaggedProgress(progress)
        for c in range(num_chunks):
            chunk_len = min(bs, prompt_len - c * bs)
            h = embed_tokens(self.params.embed, ids[:, c * bs : (c + 1) * bs])
            groups, ring = self._stream([range(c)] * len(layers))
            for l, layer in enumerate(layers):
                q, kv, state = chunk_begin(self.cfg, layer, h, self.inv_freq, jnp.int32(c * bs))
                state = self._attend_groups(ring, groups[l], q, state)
                h = chunk_end(self.cfg, self.impl, layer, h, q, kv, jnp.int32(chunk_len), state)
                self._keep_block(l, c, kv, chunk_len)
            if keep_all or c == num_chunks - 1:
                outputs.append(h)
            done.step(h, chunk_len)
        done.close()
        if keep_all:
            return jnp.concatenate(outputs, axis=1), 0
        return outputs[0], (num_chunks - 1) * bs

    def _prefill_layerwise(self, x: jax.Array, prompt_len: int, progress) -> jax.Array:
        length = jnp.int32(prompt_len)
        done = LaggedProgress(progress)
        for l, layer in enumerate(self.params.layers):
            x, blocks = layerwise_layer(self.cfg, self.impl, self.block_size, layer, x, self.inv_freq, length)
            for b, block in enumerate(blocks):
                self._keep_block(l, b, block, min(self.block_size, prompt_len - b * self.block_size))
            done.step(x, prompt_len / len(self.params.layers))
        done.close()
        return x

    def _keep_block(self, layer: int, index: int, block: jax.Array, filled: int) -> None:
        """A full block goes to the host store; a partial one stays on the GPU as the layer's tail."""
        if filled == self.block_size:
            self.store.write(layer, index, block)
        elif filled > 0:
            self._tails[layer] = block

    # ---- decode --------------------------------------------------------------------------------

    def decode(self, x: jax.Array, position: int) -> jax.Array:
        """x [1, 1, hidden] embedded new token at `position` -> its final hidden state."""
        layers = self.params.layers
        pos, tail_len = jnp.int32(position), jnp.int32(self._tail_len)
        groups, ring = self._stream([self.policy.select(l, self.store.num_written(l)) for l in range(len(layers))])
        for l, layer in enumerate(layers):
            q, self._tails[l], state = decode_begin(self.cfg, layer, x, self.inv_freq, self._tails[l], pos, tail_len)
            state = self._attend_groups(ring, groups[l], q, state)
            x = decode_end(self.cfg, self.impl, layer, x, q, self._tails[l], tail_len, state)
        self._tail_len += 1
        if self._tail_len == self.block_size:
            # The tail is full: flush it as the next host block and start an empty one.
            for l in range(len(layers)):
                self.store.write(l, self.store.num_written(l), self._tails[l])
            self._tails = [self._empty_tail() for _ in layers]
            self._tail_len = 0
        return x

    def finish(self) -> None:
        """Ends the request: host blocks count as unwritten, tails are dropped."""
        self.store.reset()
        self._tails, self._tail_len = [], 0
