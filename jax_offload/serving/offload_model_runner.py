"""The batch engine's model runner with the KV cache offloaded: several requests share the pinned host store.

A running sequence's full KV blocks live in the host store at the ids of its block table (the same id in every
layer; the block manager hands them out), and its newest, partial block in one row (its tail slot) of a GPU tail
pool per layer. Prefill runs each new prompt through the one-request `OffloadRunner` (chunked or layerwise, full or
XAttention, into the sequence's blocks) and takes its tails over. A decode step runs the layer's matmuls for the
whole batch in one call; each request's host blocks then stream through the ring group by group and are attended
row by row with the one-request step, so a request's attention does not depend on its neighbours; the tails are
attended for the whole batch in one call. KV never has to leave the GPU for a preemption (it is already on the
host): a preempted sequence gives its blocks back and is recomputed. With prefix caching a prompt's leading full
blocks may be an earlier prompt's, still in the store: its prefill starts after them, chunk by chunk.

With sketch or Quest decode the store keeps the dense layers in GPU memory and the others in one pinned buffer each,
and the policy's metadata by store block: a row attends its dense layers through its block table and the pages its
policy chooses from its own metadata (gathered by its page table), as the one-request step reads them; every row of
such a layer runs in one program (rows with one page-table length): one gather and one kernel call score every row's
pages (each as alone), then one top-k, one plan and copy of the page cache (each request's region, the regions' maps
stacked a layer) and one paged-kernel call for all of them. When all rows are of one kind, consecutive sparse layers
run as one program, as the one-request step runs them; the dense layers always do. Steps run ahead: a step is
dispatched before the last one's tokens are read (`decode_async`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from jax_offload.attention import (cached_pages_attend_rows, chosen_pages_attend_rows, embed_tokens,
                                   layer_group_executable, pooled_decode_begin, pooled_decode_end,
                                   pooled_pages_decode_layers, pooled_stored_decode_layers)
from jax_offload.buckets import layer_group_size
from jax_offload.device_runner import pad_ids
from jax_offload.kv.ring import BlockRing, grouped
from jax_offload.offload_runner import OffloadRunner
from jax_offload.progress import prefill_bar
from jax_offload.sampling import Drawn, TokenLogprobs, drawn_to_host
from jax_offload.serving.model_runner import (batch_buckets, device_rows, feed_step_tokens, sample_last,
                                              sampling_batch)
from jax_offload.serving.sequence import Sequence
from jax_offload.sparse import xattention


def _padded(rows, empty: int) -> list[int]:
    """`rows` then `empty` (a padding row's index) up to a power of two of entries."""
    rows = list(rows)
    return rows + [empty] * ((1 << (len(rows) - 1).bit_length()) - len(rows))


def _layer_groups(layers: list[int]) -> list[list[int]]:
    """Layers -> runs of consecutive ones, each cut into equal groups (`layer_group_size`)."""
    runs: list[list[int]] = []
    for l in layers:
        if runs and runs[-1][-1] == l - 1:
            runs[-1].append(l)
        else:
            runs.append([l])
    return [run[i:i + layer_group_size(len(run))] for run in runs
            for i in range(0, len(run), layer_group_size(len(run)))]


def _row_kinds(tables: list, cached: dict[int, tuple]) -> dict[tuple[int, bool], list[int]]:
    """The rows by kind, (page-table length, through regions of the page cache); none without a page policy."""
    kinds: dict[tuple[int, bool], list[int]] = {}
    if tables and tables[0] is not None:
        for row, table in enumerate(tables):
            kinds.setdefault((table[2].shape[0], row in cached), []).append(row)
    return kinds


@jax.jit
def _step_rows(drawn: jax.Array, packed: jax.Array) -> tuple:
    """(tokens, tail slots, positions, tail lengths, page cache regions, steps through them) [B] of a decode step from
    its rows packed [B, 7] (token, the row of the previous draw that holds it or -1, tail slot, position, tail length,
    region, step), and each row's position alone (a scalar: its host blocks' attention takes it): one host-to-device
    copy a step, not seven. As outputs of one program they keep their device
    addresses from step to step, so the sparse programs that read them need no CUDA graph update before a launch
    (a region step moved by `device_put` each step made every sparse program update its graph)."""
    return (feed_step_tokens(drawn, packed), packed[:, 2], packed[:, 3], packed[:, 4], packed[:, 5], packed[:, 6],
            tuple(packed[r, 3] for r in range(packed.shape[0])))


@functools.partial(jax.jit, donate_argnums=0)
def _put_tails(pools: tuple[jax.Array, ...], slot: jax.Array, tails: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Writes one request's tails [2, block_size, Hkv, D], one per layer, into row `slot` of every layer's pool."""
    return tuple(pool.at[slot].set(tail) for pool, tail in zip(pools, tails))


@jax.jit
def _tails_at(pools: tuple[jax.Array, ...], slot: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(pool[slot] for pool in pools)


class OffloadModelRunner:
    """Runs prefill and decode steps of several requests whose KV lives in `runner`'s host store; the scheduler's
    `KVSwapper` as well (it never swaps: preempted sequences are recomputed)."""

    def __init__(self, runner: OffloadRunner, num_slots: int, is_cached: Callable[[int], bool] = lambda block: False):
        """`num_slots` tail slots: the most sequences that run at once. `is_cached(block)`: whether a block's KV
        outlives its sequence (prefix caching keeps it for later prompts)."""
        self.runner, self.store, self.is_cached = runner, runner.store, is_cached
        self.cfg, self.params, self.block_size = runner.cfg, runner.params, runner.block_size
        self.buckets = batch_buckets(num_slots)
        shape = (num_slots, 2, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        # Placed on the mesh as the steps' outputs are, so that each step compiles once, not once more per placement.
        self.tails = [jax.device_put(runner.tp.zeros(shape, runner.dtype, 3), runner.tp.sharding(3))
                      for _ in range(self.cfg.num_layers)]
        self._free_slots = list(range(num_slots))[::-1]
        self._slot: dict[int, int] = {}  # sequence index -> its tail slot
        self.host_bytes_used = 0  # swap space in use: none, ever
        self.prefill_bars = False  # a bar over each long prompt's prefill (`BatchEngine.generate`'s progress)
        # The page cache (`sparse_cache_gb`): a region of every sparse layer's cache for each of the first requests
        # to decode while regions are free; the others read their pages from the store.
        self.cache = runner.page_cache
        if self.cache is not None:
            self._region_slots = self.cache.region_slots(runner.budget_pages, num_slots)
            regions = self.cache.slots // self._region_slots
            self._free_regions = list(range(regions))[::-1]
            self._spare_region = regions  # the padding rows': they plan no page, so it stays empty
            # Per sparse layer, every region's maps stacked (one argument a layer, not three a row).
            self._region_maps = {l: self.cache.region_maps(self._region_slots, regions + 1)
                                 for l in self.cache.states}
        self._zero = jax.device_put(np.int32(0), runner.tp.sharding(None))  # a padding row's key and page counts
        # A step whose rows are all of one kind runs consecutive sparse layers as one program, in these groups.
        self._page_groups = _layer_groups([l for l, place in enumerate(self.store.places) if place == "pages"])
        # Consecutive layers kept in GPU memory (the dense layers) run as one program, whatever the rows' kinds.
        self._dense_groups = {group[0]: group for group in
                              _layer_groups([l for l, place in enumerate(self.store.places) if place == "gpu"])}
        self._row_tables: dict[int, tuple] = {}  # sequence index -> (stored blocks, its row of `_tables`)
        self._region: dict[int, int] = {}  # sequence index -> its region
        self._cache_steps: dict[int, int] = {}  # sequence index -> decode steps through its region
        self._region_args_of_step: dict[tuple, tuple] = {}  # a step's rows -> their regions and steps on the device

    def batch_size(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def prefill_tokens(self, lengths: list[int]) -> int:
        """Tokens a prefill of prompts of these lengths computes, padding included (each as long as the longest,
        a bound on the one-request prefills' activations)."""
        return len(lengths) * self.runner.padded_length(max(lengths))

    def prefill(self, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        """Runs each sequence's tokens after its cached prefix (`num_cached`, whole blocks), one sequence after
        another, and samples the next one."""
        return [self._prefill_one(seq) for seq in seqs]

    def _prefill_one(self, seq: Sequence) -> tuple[int, TokenLogprobs | None]:
        ids = seq.token_ids
        padded = pad_ids(ids, self.runner.padded_length(len(ids)))
        try:
            with prefill_bar(len(ids) - seq.num_cached, self.prefill_bars) as bar:
                hidden, first = self.runner.prefill(padded, len(ids), seq.max_len, bar, blocks=seq.block_table,
                                                    cached_blocks=seq.num_cached // self.block_size)
        finally:  # the runner lets go of the request either way; its blocks are the sequence's, dropped with it
            tails = self.runner.hand_over()
        slot = self._free_slots.pop()
        self._slot[seq.index] = slot
        self.tails = list(_put_tails(tuple(self.tails), np.int32(slot), tuple(tails)))
        last = np.asarray([len(ids) - first - 1], np.int32)
        draw = drawn_to_host(sample_last(self.cfg, self.params, hidden, last, *sampling_batch([seq], 1)), 1)[0]
        if self.runner.xattn is not None:  # read after the draw: the runner keeps the counts until its next prefill
            seq.prefill_density = xattention.density(self.runner.prefill_block_counts)
        return draw

    def decode_async(self, seqs: list[Sequence], previous: tuple[list[Sequence], Drawn] | None = None) -> Drawn:
        """Runs each sequence's last token and samples the next one, without waiting: the draw [batch bucket] stays
        on the device, so the host prepares the next step while this one runs (a step of 8 sketch requests of 64K
        keeps the host busy for most of the GPU's time). A sequence whose last token is still pending takes it from
        `previous` (the sequences and the draw of the step that drew it). A tail that fills up is stored in the
        sequence's next block."""
        runner, bs = self.runner, self.block_size
        size = self.batch_size(len(seqs))
        # token, previous draw's row, tail slot, position, tail length, page cache region, step through it
        packed = np.zeros((size, 7), np.int32)
        packed[:, 1:3] = -1
        previous_row = {id(seq): row for row, seq in enumerate(previous[0])} if previous else {}
        for row, seq in enumerate(seqs):
            if seq.num_pending:
                packed[row, 1] = previous_row[id(seq)]
            else:
                packed[row, 0] = seq.last_token
            packed[row, 2:5] = self._slot[seq.index], seq.num_cached, seq.num_cached % bs
        stored = [seq.num_cached // bs for seq in seqs]
        groups, ring = self._stream(seqs, stored)
        tables = self._tables(seqs, stored)
        cached = self._cache_rows(seqs)
        self._region_args_of_step = {}
        if cached:  # rows without a region, padding too, go through the spare one at step 0
            packed[:, 5] = self._spare_region
            for row, region_step in cached.items():
                packed[row, 5:] = region_step
        # Once a step on the device, not once per layer's two calls (each would move them again). The tokens go
        # through the previous draw even when none is pending (a stand-in no row reads): one kind of array, one
        # compile per pair of batch sizes.
        placed = runner.tp.sharding(None)
        packed = jax.device_put(packed, placed)
        tokens, slots, positions, tail_lens, regions, steps, row_positions = _step_rows(
            previous[1].tokens if previous else device_rows(size, placed), packed)
        kinds = _row_kinds(tables, cached)
        kind = next(iter(kinds)) if len(kinds) == 1 else None
        groups_at = {group[0]: group for group in self._page_groups} if kind is not None else {}
        x = embed_tokens(self.params.embed, tokens[:, None])
        for l, layer in enumerate(self.params.layers):
            if l in groups_at:
                x = self._pages_layers(groups_at[l], x, kind, slots, positions, tail_lens, tables, regions, steps)
                continue
            if l in self._dense_groups:
                x = self._dense_layers(self._dense_groups[l], x, slots, positions, tail_lens, tables)
                continue
            if self.store.places[l] == "gpu" or (self.store.places[l] == "pages" and kind is not None):
                continue  # run by its group's program
            q, q_rows, self.tails[l], states = pooled_decode_begin(
                self.cfg, layer, x, runner.inv_freq, self.tails[l], slots, positions, tail_lens, tp=runner.tp)
            # Padding rows (past the sequences) keep their empty states.
            states = self._attend(l, ring, groups[l], q_rows[:len(seqs)], states[:len(seqs)], tables, cached, kinds,
                                  row_positions) \
                + states[len(seqs):]
            x = pooled_decode_end(self.cfg, runner.impl, layer, x, q, self.tails[l], slots, tail_lens, positions,
                                  states, tp=runner.tp)
        out = sample_last(self.cfg, self.params, x, device_rows(size, placed), *sampling_batch(seqs, size))
        for seq in seqs:
            if (seq.num_cached + 1) % bs == 0:  # its tail is full: store it as the sequence's next block
                block = seq.block_table[seq.num_cached // bs]
                for l, tail in enumerate(_tails_at(tuple(self.tails), np.int32(self._slot[seq.index]))):
                    runner.write_block(l, block, tail)
        return out

    def _attend(self, layer: int, ring: BlockRing, groups: list, qs: tuple, states: tuple, tables: list,
                cached: dict[int, tuple], kinds: dict[tuple[int, bool], list[int]], row_positions: tuple) -> tuple:
        """Each row's attention over its stored KV of `layer`, as the one-request step reads it: its blocks through
        the ring ("blocks" layers, row by row), or the pages its policy chooses ("pages"), through its region of the
        page cache where it has one (`cached`: row -> (region, step)), every row of one kind in one program (rows of
        one page-table length, with or without a region: `kinds`, `_row_kinds`). `tables`: per row, (block table,
        key count, page table, page count) (`_tables`); `row_positions`: each row's position. The layers in GPU
        memory ("gpu") run as `_dense_layers`."""
        runner, store = self.runner, self.store
        place = store.places[layer]
        if place == "blocks":
            return tuple(runner.attend_groups(ring, row_groups, q, state, position=position)
                         for row_groups, q, state, position in zip(groups, qs, states, row_positions))
        # Each program takes a power of two of rows (its compiled shapes), the missing ones empty: row 0's q and
        # state (every state is still empty here) over no keys, through a region of its own that reads nothing.
        empty = len(qs)
        qs, states = qs + (qs[0],), states + (states[0],)
        pages, out = runner.pages, list(states[:empty])
        for (num_candidates, in_cache), real in kinds.items():
            rows = _padded(real, empty)
            page_tables = tuple(tables[r if r < empty else real[0]][2] for r in rows)
            args = (runner.impl, tuple(qs[r] for r in rows), pages.scorer, pages.metadata(layer), runner.budget_pages,
                    runner.page_size, self.block_size, num_candidates,
                    tuple(tables[r][3] if r < empty else self._zero for r in rows), page_tables,
                    store.layer_buffer(layer))
            places, row_states = store.gather_places(layer), tuple(states[r] for r in rows)
            if not in_cache:
                done = chosen_pages_attend_rows(*args, *places, row_states, tp=runner.tp)
            else:
                cache = self.cache
                regions, steps = self._region_args(rows, cached)
                done, kv, self._region_maps[layer], counts = cached_pages_attend_rows(
                    *args, cache.states[layer].kv, self._region_maps[layer], regions, self._region_slots, steps,
                    *places, row_states, tp=runner.tp)
                cache.states[layer] = cache.states[layer]._replace(kv=kv)
                cache.counts.append(counts)
            for r, state in zip(real, done):
                out[r] = state
        return tuple(out)

    def _dense_layers(self, group: list[int], x: jax.Array, slots, positions, tail_lens, tables: list) -> jax.Array:
        """A group of consecutive layers kept in GPU memory as one program (`pooled_stored_decode_layers`), each row
        through its block table (a padding row: row 0's table, no key). -> the hidden state after the group."""
        runner, store = self.runner, self.store
        pad = x.shape[0] - len(tables)
        blocks = tuple(t[0] for t in tables) + (tables[0][0],) * pad
        num_keys = tuple(t[1] for t in tables) + (self._zero,) * pad
        x, tails = pooled_stored_decode_layers(
            self.cfg, runner.impl, tuple(self.params.layers[l] for l in group), x, runner.inv_freq,
            tuple(self.tails[l] for l in group), slots, positions, tail_lens,
            tuple(store.layer_buffer(l) for l in group), blocks, num_keys, *store.gather_places(group[0]),
            tp=runner.tp, executable=layer_group_executable(group[0]))
        for j, l in enumerate(group):
            self.tails[l] = tails[j]
        return x

    def _pages_layers(self, group: list[int], x: jax.Array, kind: tuple[int, bool], slots, positions, tail_lens,
                      tables: list, row_regions: jax.Array, row_steps: jax.Array) -> jax.Array:
        """A group of consecutive sparse layers of a step whose rows are all of `kind` (page-table length, through
        regions of the page cache or not) as one program (`pooled_pages_decode_layers`): each padding row reads no
        page, through a region of its own that never hits or misses (`row_regions`, `row_steps`: each row's region
        and step, the spare region for padding). -> the hidden state after the group."""
        runner, store, cache = self.runner, self.store, self.cache
        num_candidates, in_cache = kind
        pad = x.shape[0] - len(tables)
        num_pages = tuple(t[3] for t in tables) + (self._zero,) * pad
        page_tables = tuple(t[2] for t in tables) + (tables[0][2],) * pad
        kvs = maps = regions = region_slots = steps = None
        if in_cache:
            kvs = tuple(cache.states[l].kv for l in group)
            maps = tuple(self._region_maps[l] for l in group)
            regions, steps, region_slots = row_regions, row_steps, self._region_slots
        layers = self.params.layers
        x, tails, kvs, maps, counts = pooled_pages_decode_layers(
            self.cfg, runner.impl, tuple(layers[l] for l in group), x, runner.inv_freq,
            tuple(self.tails[l] for l in group), slots, positions, tail_lens, runner.pages.scorer,
            tuple(runner.pages.metadata(l) for l in group), runner.budget_pages, runner.page_size, self.block_size,
            num_candidates, num_pages, page_tables, tuple(store.layer_buffer(l) for l in group), kvs, maps, regions,
            region_slots, steps, *store.gather_places(group[0]), tp=runner.tp,
            executable=layer_group_executable(group[0]))
        for j, l in enumerate(group):
            self.tails[l] = tails[j]
            if in_cache:
                cache.states[l] = cache.states[l]._replace(kv=kvs[j])
                self._region_maps[l] = maps[j]
        if in_cache:
            cache.counts.append(counts)  # [layers, rows, 3]; a padding row counts nothing
        return x

    def _cache_rows(self, seqs: list[Sequence]) -> dict[int, tuple[int, int]]:
        """Gives regions of the page cache to sequences that have none while some are free (emptied as they are
        given), starts the step's counts, and -> row -> (its region, its step through it)."""
        cache = self.cache
        if cache is None:
            return {}
        for seq in seqs:
            if seq.index not in self._region and self._free_regions:
                region = self._region[seq.index] = self._free_regions.pop()
                self._cache_steps[seq.index] = 0
                self._region_maps = cache.empty_region(self._region_maps, region)
        cache.next_step()
        rows = {}
        for row, seq in enumerate(seqs):
            if seq.index in self._region:
                self._cache_steps[seq.index] += 1
                rows[row] = (self._region[seq.index], self._cache_steps[seq.index])
        return rows

    def _region_args(self, rows: list[int], cached: dict[int, tuple[int, int]]) -> tuple[jax.Array, jax.Array]:
        """The regions and steps [len(rows)] of a program's rows (a row not in `cached`, padding: the spare region,
        step 0), on the device; moved once a step for each set of rows."""
        key = tuple(rows)
        if key not in self._region_args_of_step:
            regions = np.asarray([cached[r][0] if r in cached else self._spare_region for r in rows], np.int32)
            steps = np.asarray([cached[r][1] if r in cached else 0 for r in rows], np.int32)
            self._region_args_of_step[key] = tuple(jax.device_put([regions, steps], self.runner.tp.sharding(None)))
        return self._region_args_of_step[key]

    def _tables(self, seqs: list[Sequence], stored: list[int]) -> list:
        """Per row, what its one-buffer layers are read through (None without a page policy): its
        block table over the store's blocks (then block 0), its stored key count, its page table (each of its pages'
        store page, over the candidates its page count asks, `QuestPages.candidates`; then page 0) and page count,
        on the device. A sequence's row changes only when it stores a block, so it is built and moved then (at 64K
        tokens building and moving every row each step took ~6 ms of the host's step)."""
        store, runner = self.store, self.runner
        if runner.pages is None:  # every layer's blocks stream through the ring
            return [None] * len(seqs)
        per_block = self.block_size // runner.page_size
        new = {}
        for seq, n in zip(seqs, stored):
            if self._row_tables.get(seq.index, (None,))[0] == n:
                continue
            blocks = np.zeros(store.num_blocks, np.int32)
            blocks[:n] = seq.block_table[:n]
            num_pages = n * per_block
            page_table = np.zeros(runner.pages.candidates(num_pages, runner.budget_pages), np.int32)
            page = np.arange(num_pages)
            page_table[:num_pages] = blocks[page // per_block] * per_block + page % per_block
            new[seq.index] = n, (blocks, np.int32(n * self.block_size), page_table, np.int32(num_pages))
        moved = jax.device_put([row for _, row in new.values()], runner.tp.sharding(None))  # one transfer
        for (i, (n, _)), row in zip(new.items(), moved):
            self._row_tables[i] = (n, row)
        return [self._row_tables[seq.index][1] for seq in seqs]

    def _stream(self, seqs: list[Sequence], stored: list[int]):
        """Per layer and row, the row's stored blocks of a "blocks" layer in ring groups (as one request groups
        them), and a ring that streams them layer by layer, row by row."""
        places = self.store.places
        groups = [[grouped([(l, seq.block_table[b]) for b in range(n)] if places[l] == "blocks" else [],
                           self.runner.group)
                   for seq, n in zip(seqs, stored)] for l in range(self.cfg.num_layers)]
        schedule = (g for layer_groups in groups for row_groups in layer_groups for g in row_groups)
        return groups, BlockRing(self.store, self.runner.num_slots, schedule)

    # ---- KVSwapper ----------------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return False

    def swap_out(self, seq: Sequence) -> None:
        raise RuntimeError("An offloaded KV cache is already in host memory; preempted sequences are recomputed.")

    def swap_in(self, seq: Sequence) -> None:
        raise RuntimeError("An offloaded KV cache is already in host memory; preempted sequences are recomputed.")

    def drop(self, seq: Sequence) -> None:
        """Forgets the sequence's stored blocks (but those prefix caching keeps) and frees its tail slot and its
        region of the page cache."""
        self.store.forget([b for b in seq.block_table if not self.is_cached(b)])
        self._row_tables.pop(seq.index, None)
        slot = self._slot.pop(seq.index, None)
        if slot is not None:
            self._free_slots.append(slot)
        region = self._region.pop(seq.index, None)
        if region is not None:
            self._free_regions.append(region)
            del self._cache_steps[seq.index]

    @property
    def cache_regions_in_use(self) -> int:
        """Regions of the page cache held by sequences."""
        return len(self._region)

    @property
    def sequences_held(self) -> int:
        """Sequences whose tail slot, cache region or tables the runner still keeps."""
        return len(set(self._slot) | set(self._region) | set(self._row_tables) | set(self._cache_steps))
