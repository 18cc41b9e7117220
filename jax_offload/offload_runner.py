"""Runs the model with the KV cache in pinned host memory, streamed back through the GPU ring.

Per request the state is: full blocks in the host store and one partial block per layer on the GPU (the tail)
holding the tokens not yet flushed. `finish` clears both, always. A request's logical block i lives in the store's
block i, or in `blocks[i]` when prefill is given a block table (the batch engine runs several requests over one
store, `serving/offload_model_runner.py`, and takes each prefilled request over with `hand_over`).

With a page-choosing decode policy ("sketch", `sparse/sketch.py`, or "quest", `sparse/quest.py`) the first
`dense_layers` layers keep their blocks in GPU memory and attend in full; every other layer keeps its blocks in
one pinned buffer, and each decode step reads, per KV head, the pages the policy chose from it by its metadata on
the GPU (the key sketch, or Quest's bounds), written with every stored block: with the Pallas kernels on a GPU the
attention kernel reads them in place over PCIe, otherwise they are gathered on the host and moved. Each layer is one
program per step (with the page cache, `sparse/page_cache.py`, consecutive sparse layers share one), and the step's
scalars reach the GPU once (each eager scalar costs the host more than a layer's GPU work at this size).
Prefill reads every block in either case.

With prefill_policy="xattention", layerwise prefill attends each layer's whole prompt block-sparsely on the GPU;
chunked prefill streams a chunk's earlier blocks once a layer into GPU key and value buffers, over which the chunk
makes XAttention's estimate and attends the blocks it chose (`sparse/xattention.py`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.attention import (
    attend_blocks,
    cached_sparse_decode_layers,
    chunk_begin,
    chunk_end,
    decode_begin,
    decode_end,
    dense_stored_layer,
    embed_tokens,
    gather_kv,
    layerwise_layer,
    reads_rows_in_place,
    sparse_decode_layer,
    xattn_chunk_layer,
)
from jax_offload.buckets import key_span_bucket, prompt_bucket
from jax_offload.config import PAGE_POLICIES, EngineConfig, ModelConfig, round_up
from jax_offload.kv.host_store import HostKVStore
from jax_offload.kv.kv_cache_dtype import bytes_per_vector
from jax_offload.kv.ring import BlockRing, Key, decode_group_size, group_size, grouped, padded
from jax_offload.models.params import ModelParams
from jax_offload.progress import LaggedProgress
from jax_offload.sparse import xattention
from jax_offload.sparse.page_cache import PageCache
from jax_offload.sparse.quest import QuestPages
from jax_offload.sparse.sketch import KeySketch
from jax_offload.tensor_parallel import TensorParallel
from pallas_kernels import AttentionState
from pallas_kernels.sketch import hopper_scores_int4_words


# Compiles a chunked XAttention prefill's program for its next key span while the chunks of this span run (each new
# span of a 1M-token prompt stalled the prefill 10-25 s on an H200, bench/results/runs/h200_1m_prefill/).
_SPAN_COMPILER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jax_offload-span-compile")


def compiles_ahead() -> bool:
    """Whether a chunked prefill compiles its next key span's program on a thread: on a GPU, where a 1M-token prompt's
    span compiled in 10-17 s, not on the CPU, where compiles take little; JAX_OFFLOAD_COMPILE_AHEAD=1 or 0 decides
    instead."""
    setting = os.environ.get("JAX_OFFLOAD_COMPILE_AHEAD")
    if setting not in (None, "0", "1"):
        raise ValueError(f"JAX_OFFLOAD_COMPILE_AHEAD is {setting!r}; allowed: 0 or 1")
    return jax.default_backend() != "cpu" if setting is None else setting == "1"


class OffloadRunner:
    """The request's KV in the pinned-host store; attention streams it back group by group through the ring.
    Under tensor parallelism the store, the ring's slots and the tails are split by KV heads: each device streams
    its own heads, and every transfer is one per device."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: ModelParams,
        inv_freq: jax.Array,
        dtype: jnp.dtype,
        impl: str,
        engine: EngineConfig,
        tp: TensorParallel,
    ):
        self.cfg, self.params, self.inv_freq, self.dtype, self.impl, self.tp = cfg, params, inv_freq, dtype, impl, tp
        self.block_size, self.num_slots, self.mode = engine.block_size, engine.num_ring_slots, engine.prefill
        self.group = group_size(engine.num_ring_slots)
        self.span_compiles: dict[int, Future] = {}  # key span -> its chunk program compiled ahead on a thread
        self.span_compile_chunks: dict[int, int] = {}  # key span -> the chunk during which its compile began
        num_blocks = -(-engine.host_kv_tokens // engine.block_size)
        # The page-choosing policy's metadata on the GPU (Quest's bounds or the key sketch), None for full decode.
        self.pages: QuestPages | KeySketch | None = None
        self.page_cache: PageCache | None = None  # recently chosen pages in GPU memory (`sparse_cache_gb`)
        places = ["blocks"] * cfg.num_layers
        if engine.decode_policy in PAGE_POLICIES:
            dense = engine.dense_layers
            places = ["gpu"] * dense + ["pages"] * (cfg.num_layers - dense)
            num_pages = num_blocks * engine.block_size // engine.page_size
            # A budget past max_model_len reads every page.
            self.budget_pages, self.page_size = min(engine.decode_budget // engine.page_size, num_pages), engine.page_size
            self.page_bytes = 2 * engine.page_size * cfg.num_kv_heads * bytes_per_vector(
                engine.kv_cache_dtype, cfg.head_dim, dtype)
            sparse_layers = list(range(dense, cfg.num_layers))
            if engine.decode_policy == "quest":
                self.pages = QuestPages(sparse_layers, num_pages, cfg.num_kv_heads, cfg.head_dim, engine.page_size,
                                        dtype, tp)
            else:
                local_heads = cfg.num_kv_heads // tp.size
                words = impl == "pallas" and hopper_scores_int4_words(
                    dtype, local_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, engine.page_size, num_pages)
                self.pages = KeySketch(sparse_layers, num_blocks * engine.block_size, cfg.num_kv_heads, cfg.head_dim,
                                       engine.page_size, engine.sketch_dtype, tp, words=words)
            if engine.sparse_cache_gb and sparse_layers:
                slots = int(engine.sparse_cache_gb * 2**30 // (len(sparse_layers) * self.page_bytes))
                if slots < self.budget_pages:
                    least = self.budget_pages * len(sparse_layers) * self.page_bytes / 2**30
                    raise ValueError(f"sparse_cache_gb {engine.sparse_cache_gb} holds {slots} pages per KV head and "
                                     f"layer, fewer than the decode budget's {self.budget_pages}; give at least "
                                     f"{least:.3g}, or 0 for no cache.")
                self.page_cache = PageCache(sparse_layers, min(slots, num_pages), self.budget_pages, num_pages,
                                            cfg.num_kv_heads, engine.page_size, cfg.head_dim, dtype,
                                            engine.kv_cache_dtype, tp)
        self.store = HostKVStore(
            cfg.num_layers, num_blocks, engine.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, tp, places,
            kv_cache_dtype=engine.kv_cache_dtype)
        self.xattn = xattention.policy_of(engine)
        self._decode_pcie_bytes = 0  # bytes the last decode step moved from host to GPU, the page cache's aside
        self.last_prefill_pcie_bytes = 0  # bytes the last prefill moved from host to GPU
        # Page layers whose blocks the last prefill read from the prefill mirror, by its memory kind (`start_mirror`).
        self.last_prefill_mirror: dict[str, int] = {}
        self.prefill_block_counts: list[jax.Array] = []  # per layer, XAttention's [selected, visible] blocks
        # Chunked XAttention: the current layer's keys and values, for the estimate and the attention.
        self._keys: jax.Array | None = None
        self._values: jax.Array | None = None
        self._key_counts: dict[int, jax.Array] = {}  # by block count: the kernels' kv_len, on the GPU
        self._tails: list[jax.Array | None] = []
        self._tail_len = 0
        self._written = [0] * cfg.num_layers  # the request's blocks stored so far, per layer
        self._blocks: Sequence[int] = range(num_blocks)  # the request's block table: logical -> store block

    def padded_length(self, prompt_len: int) -> int:
        if self.mode == "chunked":
            return round_up(prompt_len, self.block_size)
        return round_up(prompt_bucket(prompt_len), self.block_size)

    def _empty_tail(self) -> jax.Array:
        return self.tp.zeros((2, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim), self.dtype, 2)

    # ---- streaming host blocks ---------------------------------------------------------------

    def _stream(self, blocks_per_layer: list[Sequence[int]]) -> tuple[list[list[list[Key]]], BlockRing]:
        """Per layer, its (logical) blocks in groups of `self.group`, and a ring that streams every group in that
        order."""
        groups = [grouped(self._keys_of(l, blocks), self.group) for l, blocks in enumerate(blocks_per_layer)]
        return groups, BlockRing(self.store, self.num_slots, (g for layer_groups in groups for g in layer_groups))

    def _keys_of(self, layer: int, blocks: Sequence[int]) -> list[Key]:
        """The store keys of the request's logical `blocks` of `layer`."""
        return [(layer, self._blocks[b]) for b in blocks]

    def attend_groups(self, ring: BlockRing, layer_groups: list[list[Key]], q: jax.Array,
                      state: AttentionState, whole_groups: bool = False,
                      position: jax.Array | None = None) -> AttentionState:
        """Continues the attention state over each of the layer's groups, handing each group's slots back. Each
        group is padded with repeats of its last block (which the kernels skip, reading `kv_len` keys): to the
        whole group size with `whole_groups` (prompt chunks: one program), else to a power of two (decode steps:
        a few programs, and few repeats copied). A decode token passes its `position` (`attend_blocks`)."""
        for g in layer_groups:
            size = self.group if whole_groups else decode_group_size(len(g), self.group)
            blocks = padded(tuple(ring.take()), size)
            state = attend_blocks(self.impl, q, blocks, state, self._num_keys(len(g)), position, tp=self.tp)
            ring.release(state.m, len(g))
        return state

    def _num_keys(self, num_blocks: int) -> jax.Array:
        """The key count of `num_blocks` blocks, on the GPU (made once per count, not once per call)."""
        if num_blocks not in self._key_counts:
            count = np.int32(num_blocks * self.block_size)
            self._key_counts[num_blocks] = jax.device_put(count, self.tp.sharding(None))
        return self._key_counts[num_blocks]

    # ---- prefill -------------------------------------------------------------------------------

    def prefill(
        self,
        ids: np.ndarray,
        prompt_len: int,
        total_len: int,
        progress: Callable[[float], None] | None = None,
        keep_all: bool = False,
        blocks: Sequence[int] | None = None,
        cached_blocks: int = 0,
    ) -> tuple[jax.Array, int]:
        """ids [1, T] prompt padded by `padded_length` -> (final hidden states [1, T', hidden], position of
        their first row). Chunked prefill keeps only the last chunk's rows unless `keep_all`, so GPU memory
        does not grow with the prompt. `progress(tokens)` is told how much is done as work completes. `blocks`
        is the request's block table (default: the store's blocks 0, 1, ...; full attention only), whose first
        `cached_blocks` already hold the prompt's KV (a cached prefix): prefill then runs chunk by chunk after
        them, as chunked prefill would. `total_len` is the in-GPU runner's argument (it sizes that runner's cache;
        the store here is sized for host_kv_tokens)."""
        if blocks is not None:
            if len(blocks) < prompt_len // self.block_size:
                raise ValueError(f"A block table of {len(blocks)} blocks cannot hold a {prompt_len}-token prompt.")
        if cached_blocks and (blocks is None or self.xattn is not None or cached_blocks * self.block_size >= prompt_len):
            raise ValueError(f"cached_blocks {cached_blocks} needs a block table, full attention and a prompt longer "
                             f"than them ({prompt_len} tokens).")
        self._blocks = range(self.store.num_blocks) if blocks is None else list(blocks)
        self._written = [cached_blocks] * self.cfg.num_layers
        if self.page_cache is not None:
            self.page_cache.reset()
        self._tails = [None] * self.cfg.num_layers
        self.last_prefill_pcie_bytes = 0
        self.last_prefill_mirror = {}
        self.prefill_block_counts = [jnp.zeros(2, jnp.int32)] * self.cfg.num_layers
        if self.mode == "chunked" or cached_blocks:
            ids = ids[:, : round_up(prompt_len, self.block_size)]  # layerwise pads further
            self.last_prefill_mirror = self.store.start_mirror(prompt_len // self.block_size)
            try:
                out = self._prefill_chunked(ids, prompt_len, progress, keep_all, cached_blocks)
            finally:
                self.store.stop_mirror()
        else:
            out = self._prefill_layerwise(embed_tokens(self.params.embed, ids), prompt_len, progress), 0
        self._tail_len = prompt_len % self.block_size
        self._tails = [self._empty_tail() if t is None else t for t in self._tails]
        return out

    def _prefill_chunked(self, ids: np.ndarray, prompt_len: int, progress, keep_all: bool,
                         first_chunk: int = 0) -> tuple[jax.Array, int]:
        bs, layers = self.block_size, self.params.layers
        outputs = []
        num_chunks = ids.shape[1] // bs
        done = LaggedProgress(progress)
        if self.xattn is not None:
            shape = (1, self.store.num_blocks * bs, self.cfg.num_kv_heads, self.cfg.head_dim)
            self._keys, self._values = self.tp.zeros(shape, self.dtype, 2), self.tp.zeros(shape, self.dtype, 2)
        for c in range(first_chunk, num_chunks):
            chunk_len = min(bs, prompt_len - c * bs)
            h = embed_tokens(self.params.embed, ids[:, c * bs : (c + 1) * bs])
            if self.xattn is None:
                groups, ring = self._stream([range(c)] * len(layers))
                self.last_prefill_pcie_bytes += c * self._pcie_layers() * self.store.block_bytes
            start, length = self.tp.replicate((np.int32(c * bs), np.int32(chunk_len)))
            for l, layer in enumerate(layers):
                q, kv, state = chunk_begin(self.cfg, layer, h, self.inv_freq, start, tp=self.tp)
                if self.xattn is None:
                    state = self.attend_groups(ring, groups[l], q, state, whole_groups=True)
                    h = chunk_end(self.cfg, self.impl, layer, h, q, kv, length, state, tp=self.tp)
                else:
                    if l == 0:
                        self._compile_next_span(layer, h, q, kv, c, num_chunks)
                    h = self._xattn_chunk_layer(l, layer, h, q, kv, c, chunk_len)
                self._keep_block(l, c, kv, chunk_len)
            if keep_all or c == num_chunks - 1:
                outputs.append(h)
            done.step(h, chunk_len)
        done.close()
        self._keys = self._values = None
        if keep_all:
            return jnp.concatenate(outputs, axis=1), first_chunk * bs
        return outputs[0], (num_chunks - 1) * bs

    def _pcie_layers(self) -> int:
        return sum(self.store.reads_cross_pcie(l) for l in range(self.cfg.num_layers))

    def _span(self, chunk: int) -> int:
        """Keys of the layer's buffers that chunk `chunk`'s estimate and attention read (`key_span_bucket`)."""
        return min(key_span_bucket((chunk + 1) * self.block_size), self._keys.shape[1])

    def _compile_next_span(self, layer, h, q, kv, c: int, num_chunks: int) -> None:
        """Starts compiling, on a thread, the chunk program of the key span after chunk c's, from the second chunk
        of chunk c's span on (the first compiled its span's program on this thread; two compiles at once are left
        out): the chunks of this span run meanwhile (a compile at 1M took 10-17 s, a chunk 3-5 s), and the first
        chunk of the next span finds it compiled (JAX's cache holds what `lower(...).compile()` made for the same
        shapes, shardings and static arguments)."""
        if c == 0 or self._span(c - 1) != self._span(c) or not compiles_ahead():
            return
        span = next((s for s in map(self._span, range(c + 1, num_chunks)) if s != self._span(c)), None)
        if span is None or span in self.span_compiles:
            return
        self.span_compile_chunks[span] = c

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x

        args = jax.tree.map(abstract, (layer, h, q, kv, self._keys, self._values))
        self.span_compiles[span] = _SPAN_COMPILER.submit(
            lambda: xattn_chunk_layer.lower(self.cfg, self.impl, self.xattn, *args, np.int32(0), np.int32(0),
                                            span=span, tp=self.tp).compile())

    def _xattn_chunk_layer(self, l: int, layer, h, q, kv, c: int, chunk_len: int) -> jax.Array:
        """One layer of a prompt chunk under XAttention: the earlier blocks stream once into the layer's key and value
        buffers, then the estimate and the attention over the chosen blocks read those (`xattn_chunk_layer`)."""
        bs = self.block_size
        ring = BlockRing(self.store, self.num_slots, grouped(self._keys_of(l, range(c)), self.group))
        for g in grouped(range(c), self.group):
            starts = np.array(padded(g, self.group, fill=c), np.int32) * bs
            self._keys, self._values, done = gather_kv(self._keys, self._values, padded(ring.take(), self.group),
                                                       starts)
            ring.release(done, len(g))
        if self.store.reads_cross_pcie(l):
            self.last_prefill_pcie_bytes += c * self.store.block_bytes
        span = self._span(c)
        h, self._keys, self._values, counts = xattn_chunk_layer(
            self.cfg, self.impl, self.xattn, layer, h, q, kv, self._keys, self._values, np.int32(c * bs),
            np.int32(chunk_len), span=span, tp=self.tp)
        self.prefill_block_counts[l] = self.prefill_block_counts[l] + counts
        return h

    def _prefill_layerwise(self, x: jax.Array, prompt_len: int, progress) -> jax.Array:
        length = np.int32(prompt_len)
        done = LaggedProgress(progress)
        for l, layer in enumerate(self.params.layers):
            x, blocks, self.prefill_block_counts[l] = layerwise_layer(
                self.cfg, self.impl, self.block_size, layer, x, self.inv_freq, length, xattn=self.xattn, tp=self.tp)
            for b, block in enumerate(blocks):
                self._keep_block(l, b, block, min(self.block_size, prompt_len - b * self.block_size))
            done.step(x, prompt_len / len(self.params.layers))
        done.close()
        return x

    def _keep_block(self, layer: int, index: int, block: jax.Array, filled: int) -> None:
        """A full block goes to the store; a partial one stays on the GPU as the layer's tail."""
        if filled == self.block_size:
            self._write(layer, index, block)
        elif filled > 0:
            self._tails[layer] = block

    def _write(self, layer: int, index: int, block: jax.Array) -> None:
        """Stores the request's logical block `index` of `layer`; blocks are written in order."""
        if index != self._written[layer]:
            raise RuntimeError(f"Block {index} of layer {layer} written out of order (next is {self._written[layer]}).")
        self.write_block(layer, self._blocks[index], block)
        self._written[layer] += 1

    def write_block(self, layer: int, block: int, kv: jax.Array) -> None:
        """Stores kv [2, block_size, Hkv, D] as store block `block` of `layer`, with the page policy's metadata of
        it (kept by store block: the batch engine's requests share the store)."""
        if self.pages is not None:
            self.pages.record(layer, block, kv)
        self.store.write(layer, block, kv)

    # ---- decode --------------------------------------------------------------------------------

    def decode(self, x: jax.Array, position: int) -> jax.Array:
        """x [1, 1, hidden] embedded new token at `position` -> its final hidden state."""
        layers, store = self.params.layers, self.store
        streamed = [range(self._written[l]) if place == "blocks" else [] for l, place in enumerate(store.places)]
        groups, ring = self._stream(streamed)
        moved = sum(len(b) for b in streamed) * store.block_bytes
        # Every layer holds the same blocks. The step's scalars go to the GPU once, not once per layer's call.
        written = self._written[0]
        pos, tail_len = jax.device_put([np.int32(position), np.int32(self._tail_len)], self.tp.sharding(None))
        if self.pages is not None:
            pages = written * (self.block_size // self.page_size)
            num_keys, num_pages = jax.device_put([np.int32(written * self.block_size), np.int32(pages)],
                                                 self.tp.sharding(None))
            candidates = self.pages.candidates(pages, self.budget_pages)
            if self.page_cache is not None:
                cache = self.page_cache
                cache.next_step()
                step = jax.device_put(np.int32(cache.step), self.tp.sharding(None))
        for l, layer in enumerate(layers):
            if store.places[l] == "gpu":
                x, self._tails[l] = dense_stored_layer(
                    self.cfg, self.impl, layer, x, self.inv_freq, self._tails[l], pos, tail_len, num_keys,
                    store.layer_buffer(l), *store.gather_places(l), tp=self.tp)
            elif store.places[l] == "pages" and self.page_cache is not None:
                if l not in cache.group_starts:
                    continue  # run by its group's program
                group = range(l, l + cache.group)
                x, tails, states, counts = cached_sparse_decode_layers(
                    self.cfg, self.impl, tuple(layers[i] for i in group), x, self.inv_freq,
                    tuple(self._tails[i] for i in group), pos, tail_len, self.pages.scorer,
                    tuple(self.pages.metadata(i) for i in group), self.budget_pages, self.page_size, self.block_size,
                    candidates, num_pages, tuple(store.layer_buffer(i) for i in group),
                    tuple(cache.states[i] for i in group), step, *store.gather_places(l), tp=self.tp)
                for i, tail, state in zip(group, tails, states):
                    self._tails[i], cache.states[i] = tail, state
                cache.counts.append(counts)
            elif store.places[l] == "pages":
                x, self._tails[l] = sparse_decode_layer(
                    self.cfg, self.impl, layer, x, self.inv_freq, self._tails[l], pos, tail_len, self.pages.scorer,
                    self.pages.metadata(l), self.budget_pages, self.page_size, self.block_size, candidates, num_pages,
                    store.layer_buffer(l), *store.gather_places(l), tp=self.tp)
                # The kernel reads each KV head's chosen pages in place; a gather moves the whole budget's rows.
                moved += (min(pages, self.budget_pages) if reads_rows_in_place(self.impl) else self.budget_pages) \
                    * self.page_bytes
            else:
                q, self._tails[l], state = decode_begin(self.cfg, layer, x, self.inv_freq, self._tails[l], pos,
                                                        tail_len, tp=self.tp)
                state = self.attend_groups(ring, groups[l], q, state, position=pos)
                x = decode_end(self.cfg, self.impl, layer, x, q, self._tails[l], tail_len, pos, state, tp=self.tp)
        self._decode_pcie_bytes = moved
        self._tail_len += 1
        if self._tail_len == self.block_size:
            # The tail is full: flush it as the next stored block and start an empty one.
            for l in range(len(layers)):
                self._write(l, self._written[l], self._tails[l])
            self._tails = [self._empty_tail() for _ in layers]
            self._tail_len = 0
        return x

    @property
    def last_decode_pcie_bytes(self) -> int:
        """Bytes the last decode step moved from host to GPU (with a page cache: read from the device)."""
        if self.page_cache is None:
            return self._decode_pcie_bytes
        _, _, pages = self.page_cache.totals()
        return self._decode_pcie_bytes + pages * self.page_bytes // self.cfg.num_kv_heads

    def finish(self) -> None:
        """Ends the request: host blocks count as unwritten, tails are dropped."""
        self.store.reset()
        self._forget_request()

    def hand_over(self) -> list[jax.Array]:
        """Ends the runner's hold on a prefilled request whose blocks stay live in the store (their new owner
        forgets them): -> its GPU tails, one per layer (prompt length % block_size tokens each)."""
        tails = self._tails
        self._forget_request()
        return tails

    def _forget_request(self) -> None:
        self._tails, self._tail_len = [], 0
        self._written = [0] * self.cfg.num_layers
        self._blocks = range(self.store.num_blocks)
