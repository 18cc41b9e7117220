"""A GPU cache of the pages sketch and Quest decode chose, per sparse layer and KV head.

A step's chosen pages are mostly those of the step before (the default model at 4K, budget 256-1024 pages: 75-81% of
them, and an LRU cache of twice the budget would hit 87-94%: bench/results/runs/cpu_page_overlap/). The cache keeps
`slots` pages of each KV head of each sparse layer in GPU memory; each step copies only its misses from the pinned
store into the least recently read slots, then attention reads every chosen page from the cache, in the order and
with the kernel it would read them from the store, so the cache changes no bit.

The copy has a static shape (the budget's rows of every KV head) but moves only the misses: on a GPU the Pallas
copy (`pallas_kernels.copy_rows`) reads each missing row in place from the pinned store and skips the rest, so the
bytes over PCIe are the misses', whatever their spread over the KV heads. A cache of at least the budget always has
room for a step's misses, so every step reads from the cache. Page ids are the request's page positions: `reset`
empties the cache when a new request starts. The batch engine cuts the cache into regions (`region_slots`), each a
request's share of every layer's slots, every region's maps of a layer stacked in one array (`region_maps`), planned
and written in place where they lie (`plan`'s rows); a region is emptied when a request takes it (`empty_region`;
`serving/offload_model_runner.py`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.buckets import layer_group_size
from jax_offload.kv import kv_cache_dtype as kv_format
from jax_offload.kv.host_store import PAGE_UNIT, gather_rows
from jax_offload.tensor_parallel import TensorParallel
from pallas_kernels.copy_rows import copy_rows

_NEVER = -1  # a slot's page when it holds none, and its last read when never read


class CacheState(NamedTuple):
    """One sparse layer's cache: `kv` a one-buffer layer of page-sized blocks [slots, Hkv, page_size / PAGE_UNIT,
    2, PAGE_UNIT, D] in the store's stored form; `page` int32 [Hkv, slots] the page each slot holds (-1: none);
    `used` int32 [Hkv, slots] the step that last read it (-1: never); `slot_of` int32 [Hkv, pages] the slot a page
    was last copied to (-1: never; the slot holds it only while `page` says so, so evictions need no update)."""

    kv: jax.Array
    page: jax.Array
    used: jax.Array
    slot_of: jax.Array


class CachePlan(NamedTuple):
    """What a step does with the cache (`plan`)."""

    slots: jax.Array  # int32 [Hkv, k]: the slot of each chosen page once the misses are copied (0 where none)
    miss_pages: jax.Array  # int32 [Hkv, k]: the chosen pages to copy in (the others: past every page)
    miss_slots: jax.Array  # int32 [Hkv, k]: their slots (the others: past every slot)
    hits: jax.Array  # int32 [Hkv]: chosen pages already cached, per KV head
    chosen: jax.Array  # int32 [Hkv]: chosen pages, per KV head
    state: CacheState  # the page maps and read steps after the step (kv not yet written)


def plan(state: CacheState, pages: jax.Array, missing: int, step: jax.Array,
         rows: jax.Array | None = None) -> CachePlan:
    """The step's use of the cache for the chosen pages [n, k] (ascending; `missing`, past every page, marks a
    missing entry, as `quest.top_pages` gives them): hits keep their slots; misses, in page order, take the least
    recently read slots not hit at this step. A cache of at least k slots always has room: hits and misses are at
    most k. Each row of pages is planned on its own, in row `rows[i]` of the maps (default: row i; with `step`
    [n, 1], each row's own): the maps of several regions stacked on the head axis are planned and written in place
    at once, as each alone. A row that plans no page (padding) leaves the maps as they were, so such rows may share
    a map row."""
    n, k = pages.shape
    slots = state.page.shape[1]
    if slots < k:
        raise ValueError(f"A cache of {slots} slots per KV head cannot hold the {k} pages a step chooses.")
    if rows is None:
        rows = jnp.arange(n)
    at = rows[:, None]
    valid = pages < missing
    # A page's last slot, looked up: a search of every slot for each chosen page cost 0.55 ms a 128K step.
    last_slot = jnp.maximum(state.slot_of[at, jnp.where(valid, pages, 0)], 0)
    hit = valid & (state.page[at, last_slot] == pages)
    hit_slot = jnp.where(hit, last_slot, 0)
    taken = jnp.zeros((n, slots), bool).at[jnp.arange(n)[:, None], hit_slot].max(hit)
    # Oldest first (never read: -1), the slots hit at this step last; ties to the lower slot.
    order = jnp.argsort(jnp.where(taken, jnp.iinfo(jnp.int32).max, state.used[rows]), axis=-1, stable=True)
    miss = valid & ~hit
    rank = jnp.cumsum(miss, axis=-1) - 1  # the i-th miss of its row takes order[i]
    new_slot = jnp.take_along_axis(order, jnp.clip(rank, 0, slots - 1), axis=-1).astype(jnp.int32)
    slot = jnp.where(hit, hit_slot, jnp.where(miss, new_slot, 0))
    written = jnp.where(miss, new_slot, slots)  # past every slot: dropped
    page = state.page.at[at, written].set(pages, mode="drop")
    used = state.used.at[at, jnp.where(valid, slot, slots)].set(step, mode="drop")
    slot_of = state.slot_of.at[at, jnp.where(miss, pages, state.slot_of.shape[1])].set(new_slot, mode="drop")
    miss_pages = jnp.where(miss, pages, missing)
    miss_slots = jnp.where(miss, new_slot, slots)
    return CachePlan(slot, miss_pages.astype(jnp.int32), miss_slots.astype(jnp.int32),
                     jnp.sum(hit, axis=-1, dtype=jnp.int32), jnp.sum(valid, axis=-1, dtype=jnp.int32),
                     CacheState(state.kv, page, used, slot_of))


def slot_rows(slots: jax.Array, num_slots: int, page_size: int, base: jax.Array | int, total_slots: int) -> jax.Array:
    """Slots [Hkv, n] of a region of `num_slots` slots starting at slot `base` of a cache of `total_slots` (>=
    num_slots: none) -> the cache's 16-token rows [Hkv, n * page_size / PAGE_UNIT], head by head, slot by slot (as
    `quest.page_rows` numbers a store layer's rows); a missing slot's rows are past every row of the cache."""
    hkv = slots.shape[0]
    units = page_size // PAGE_UNIT
    rows = ((slots[..., None] + base) * hkv + jnp.arange(hkv, dtype=jnp.int32)[:, None, None]) * units \
        + jnp.arange(units, dtype=jnp.int32)
    return jnp.where(slots[..., None] < num_slots, rows, total_slots * hkv * units).reshape(hkv, -1)


def fill(kv, buffer, store_rows: jax.Array, cache_rows: jax.Array, in_place: bool, host, device):
    """The cache's stored KV `kv` with the store rows [n] of the one-buffer layer `buffer` written at its rows
    [n] (past every cache row: skipped). `in_place` (a GPU reading the pinned store's rows in place): the Pallas copy,
    moving only the rows it keeps; otherwise the rows are gathered next to the store, moved, then written."""
    flat = jax.tree.map(lambda c: c.reshape(-1, *c.shape[-3:]), kv)
    if in_place:
        source = jax.tree.map(lambda b: b.reshape(-1, *b.shape[-3:]), buffer)
        flat = copy_rows(flat, source, store_rows, cache_rows)
    else:
        flat = jax.tree.map(lambda c, v: c.at[cache_rows].set(v, mode="drop"), flat,
                            gather_rows(buffer, store_rows, host, device))
    return jax.tree.map(lambda f, c: f.reshape(c.shape), flat, kv)


class PageCache:
    """The caches of every sparse layer, on the GPU: `slots` pages per KV head and layer, of a layer's `num_pages`."""

    def __init__(self, layers: list[int], slots: int, budget_pages: int, num_pages: int, num_kv_heads: int,
                 page_size: int, head_dim: int, dtype: jnp.dtype, kv_cache_dtype: str, tp: TensorParallel):
        if slots < budget_pages:  # the runner names the option
            raise ValueError(f"A page cache of {slots} pages per KV head is smaller than the budget's {budget_pages}.")
        self.slots = slots
        # Consecutive sparse layers run as one program (`attention.cached_sparse_decode_layers`), starting at these.
        self.group = layer_group_size(len(layers))
        self.group_starts = set(layers[::self.group])
        shape = (slots, num_kv_heads, page_size // PAGE_UNIT, 2, PAGE_UNIT, head_dim)
        self._slots_shape, self._pages_shape, self._tp = (num_kv_heads, slots), (num_kv_heads, num_pages), tp
        self.states = {l: CacheState(
            kv_format.empty(kv_cache_dtype, shape, dtype, lambda shape, dtype: tp.zeros(shape, dtype, 1)),
            *self._empty_maps()) for l in layers}
        self.nbytes = sum(leaf.nbytes for s in self.states.values() for leaf in jax.tree.leaves(s.kv))
        self.step = 0
        # Per program of the last decode step, on the device: [..., 3] of [hits, chosen, pages over PCIe] over the KV
        # heads, one row per layer (`attention.cached_sparse_decode_layers`) or request (`cached_pages_attend_rows`),
        # or per layer and request (`pooled_pages_decode_layers`).
        self.counts: list[jax.Array] = []

    def _empty_maps(self, slots: int | None = None, regions: int | None = None) -> tuple[jax.Array, ...]:
        """`page`, `used` and `slot_of` of an empty cache of `slots` slots (default: all), or of `regions` such
        regions stacked on a leading axis."""
        shape = self._slots_shape if slots is None else (self._slots_shape[0], slots)
        lead, head_axis = ((), 0) if regions is None else ((regions,), 1)
        return tuple(self._tp.zeros((*lead, *s), jnp.int32, head_axis) + _NEVER
                     for s in (shape, shape, self._pages_shape))

    def reset(self) -> None:
        """Empties the one-request path's maps (a new request: its pages are not the last one's). The batch
        engine's prefill calls it too; its regions keep maps of their own (`region_maps`), untouched here, and the
        one-request path never decodes among them (`LLM.generate` refuses)."""
        self.states = {l: CacheState(s.kv, *self._empty_maps()) for l, s in self.states.items()}
        self.step, self.counts = 0, []

    # ---- regions: the batch engine gives each of several requests its own slots of every layer's cache ----------

    def region_slots(self, budget_pages: int, requests: int) -> int:
        """Slots of a request's region: the cache shared evenly by the `requests` that may run at once, at least
        twice the budget (an LRU cache of that size held 87-94% of the default model's chosen pages:
        bench/results/runs/cpu_page_overlap/), at most every slot: one request at a time keeps the whole cache."""
        return min(self.slots, max(2 * budget_pages, self.slots // requests))

    def region_maps(self, slots: int, regions: int) -> CacheState:
        """Empty maps of `regions` regions of `slots` slots, stacked on a leading axis (kv None: region r's pages
        live in slots r * slots onward of `states[l].kv`)."""
        return CacheState(None, *self._empty_maps(slots, regions))

    @staticmethod
    def empty_region(maps: dict[int, CacheState], region: int) -> dict[int, CacheState]:
        """Every layer's `region_maps` with region `region` emptied (a request takes it: its pages are not the last
        holder's), in one program, in place."""
        return _emptied(maps, np.int32(region))

    def next_step(self) -> None:
        """Starts a decode step's counts."""
        self.step += 1
        self.counts = []

    def totals(self) -> tuple[int, int, int]:
        """The last decode step's counts over its sparse layers (reads them from the device)."""
        if not self.counts:
            return 0, 0, 0
        # Flattened on the host: a reshape on the device is one more dispatch per program (~0.2 ms of host each).
        return tuple(int(n) for n in sum(np.asarray(c, np.int64).reshape(-1, 3).sum(axis=0) for c in self.counts))

    def hit_rate(self) -> float | None:
        """Of the pages the last decode step chose, the share already cached (None before any step)."""
        hits, chosen, _ = self.totals()
        return hits / chosen if chosen else None


@functools.partial(jax.jit, donate_argnums=(0,))
def _emptied(maps: dict[int, CacheState], region: jax.Array) -> dict[int, CacheState]:
    return jax.tree.map(lambda m: m.at[region].set(_NEVER), maps)
