"""A GPU cache of the pages sketch and Quest decode chose, per sparse layer and KV head.

A step's chosen pages are mostly those of the step before (the default model at 4K, budget 256-1024 pages: 75-81% of
them, and an LRU cache of twice the budget would hit 87-94%: bench/results/runs/cpu_page_overlap/). The cache keeps
`slots` pages of each KV head of each sparse layer in GPU memory; each step copies only its misses from the pinned
store into the least recently read slots, then attention reads every chosen page from the cache, in the order and
with the kernel it would read them from the store, so the cache changes no bit.

A step copies `miss_cap` pages per KV head (the copy has a static shape: that many cross whatever the misses): the
whole budget at a request's first step, then a power of two at least twice the previous step's most misses of a KV
head. A step with more misses reads its pages from the store as it would without the cache, and still caches
`miss_cap` of them. Page ids are the request's page positions: `reset` empties the cache when a new request starts.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_offload.kv import kv_cache_dtype as kv_format
from jax_offload.kv.host_store import PAGE_UNIT
from jax_offload.tensor_parallel import TensorParallel

_NEVER = -1  # a slot's page when it holds none, and its last read when never read


class CacheState(NamedTuple):
    """One sparse layer's cache: `kv` a one-buffer layer of page-sized blocks [slots, Hkv, page_size / PAGE_UNIT,
    2, PAGE_UNIT, D] in the store's stored form; `page` int32 [Hkv, slots] the page each slot holds (-1: none);
    `used` int32 [Hkv, slots] the step that last read it (-1: never)."""

    kv: jax.Array
    page: jax.Array
    used: jax.Array


class CachePlan(NamedTuple):
    """What a step does with the cache (`plan`)."""

    slots: jax.Array  # int32 [Hkv, k]: the slot of each chosen page once the misses are copied (0 where none)
    miss_pages: jax.Array  # int32 [Hkv, miss_cap]: pages to copy in (missing: past every page)
    miss_slots: jax.Array  # int32 [Hkv, miss_cap]: their slots (missing: past every slot)
    all_cached: jax.Array  # bool: every chosen page is in the cache after the copy
    hits: jax.Array  # int32: chosen pages already cached, over the KV heads
    chosen: jax.Array  # int32: chosen pages, over the KV heads
    max_misses: jax.Array  # int32: the most chosen pages a KV head lacked
    state: CacheState  # the page map and read steps after the step (kv not yet written)


def plan(state: CacheState, pages: jax.Array, missing: int, step: jax.Array, miss_cap: int) -> CachePlan:
    """The step's use of the cache for the chosen pages [Hkv, k] (ascending; `missing`, past every page, marks a
    missing entry, as `quest.top_pages` gives them): hits keep their slots; misses, in page order, take the least
    recently read slots not hit at this step, up to `miss_cap` per KV head. A cache of at least k slots always has
    room: hits and misses are at most k."""
    hkv, slots = state.page.shape
    heads = jnp.arange(hkv)[:, None]
    valid = pages < missing
    match = (state.page[:, None, :] == pages[:, :, None]) & valid[:, :, None]  # [Hkv, k, slots]
    hit = jnp.any(match, axis=-1)
    hit_slot = jnp.argmax(match, axis=-1).astype(jnp.int32)
    taken = jnp.zeros((hkv, slots), bool).at[heads, hit_slot].max(hit)
    # Oldest first (never read: -1), the slots hit at this step last; ties to the lower slot.
    order = jnp.argsort(jnp.where(taken, jnp.iinfo(jnp.int32).max, state.used), axis=-1, stable=True)
    miss = valid & ~hit
    rank = jnp.cumsum(miss, axis=-1) - 1  # the i-th miss of its head takes order[i]
    fits = miss & (rank < miss_cap)
    new_slot = jnp.take_along_axis(order, jnp.clip(rank, 0, slots - 1), axis=-1).astype(jnp.int32)
    slot = jnp.where(hit, hit_slot, jnp.where(fits, new_slot, 0))
    written = jnp.where(fits, new_slot, slots)  # past every slot: dropped
    page = state.page.at[heads, written].set(pages, mode="drop")
    used = state.used.at[heads, jnp.where(hit | fits, slot, slots)].set(step, mode="drop")
    first = jnp.argsort(~fits, axis=-1, stable=True)[:, :miss_cap]  # the misses that fit, in page order
    copied = jnp.take_along_axis(fits, first, axis=-1)
    miss_pages = jnp.where(copied, jnp.take_along_axis(pages, first, axis=-1), missing)
    miss_slots = jnp.where(copied, jnp.take_along_axis(new_slot, first, axis=-1), slots)
    return CachePlan(slot, miss_pages.astype(jnp.int32), miss_slots.astype(jnp.int32), ~jnp.any(miss & ~fits),
                     jnp.sum(hit, dtype=jnp.int32), jnp.sum(valid, dtype=jnp.int32),
                     jnp.max(jnp.sum(miss, axis=-1, dtype=jnp.int32)), CacheState(state.kv, page, used))


def slot_rows(slots: jax.Array, num_slots: int, page_size: int) -> jax.Array:
    """Slots [Hkv, n] (>= num_slots: none) -> the cache's 16-token rows [Hkv, n * page_size / PAGE_UNIT], head by
    head, slot by slot (as `quest.page_rows` numbers a store layer's rows); a missing slot's rows are past every
    row."""
    hkv = slots.shape[0]
    units = page_size // PAGE_UNIT
    rows = (slots[..., None] * hkv + jnp.arange(hkv, dtype=jnp.int32)[:, None, None]) * units \
        + jnp.arange(units, dtype=jnp.int32)
    return jnp.where(slots[..., None] < num_slots, rows, num_slots * hkv * units).reshape(hkv, -1)


def write_rows(kv, rows: jax.Array, values):
    """The cache's stored KV with `values` [n, 2, PAGE_UNIT, D] (each leaf of a stored form, as `gather_rows`
    gives them) written at its rows [n] (past every row: dropped)."""
    return jax.tree.map(lambda c, v: c.reshape(-1, *c.shape[-3:]).at[rows].set(v, mode="drop").reshape(c.shape),
                        kv, values)


class PageCache:
    """The caches of every sparse layer, on the GPU: `slots` pages per KV head and layer."""

    def __init__(self, layers: list[int], slots: int, budget_pages: int, num_kv_heads: int, page_size: int,
                 head_dim: int, dtype: jnp.dtype, kv_cache_dtype: str, tp: TensorParallel):
        if slots < budget_pages:  # the runner names the option
            raise ValueError(f"A page cache of {slots} pages per KV head is smaller than the budget's {budget_pages}.")
        self.slots, self.budget_pages = slots, budget_pages
        self.miss_cap = budget_pages
        shape = (slots, num_kv_heads, page_size // PAGE_UNIT, 2, PAGE_UNIT, head_dim)
        self._map_shape, self._tp = (num_kv_heads, slots), tp
        self.states = {l: CacheState(
            kv_format.empty(kv_cache_dtype, shape, dtype, lambda shape, dtype: tp.zeros(shape, dtype, 1)),
            self._never(), self._never()) for l in layers}
        self.nbytes = sum(leaf.nbytes for s in self.states.values() for leaf in jax.tree.leaves(s.kv))
        self.step = 0
        # Per sparse layer of the last decode step, on the device: [hits, chosen, pages over PCIe] over the KV
        # heads and the most misses of a KV head (`attention.cached_sparse_decode_layer`).
        self.counts: list[jax.Array] = []

    def _never(self) -> jax.Array:
        return self._tp.zeros(self._map_shape, jnp.int32, 0) + _NEVER

    def reset(self) -> None:
        """Empties every slot (a new request: its pages are not the last one's)."""
        self.states = {l: CacheState(s.kv, self._never(), self._never()) for l, s in self.states.items()}
        self.step, self.miss_cap, self.counts = 0, self.budget_pages, []

    def next_step(self) -> None:
        """Sizes the coming step's copy from the last step's misses (read from the device: that step is done once
        its token was read) and starts its counts."""
        if self.counts:
            most = max(int(c[3]) for c in self.counts)
            self.miss_cap = min(self.budget_pages, 1 << max(2 * most - 1, 0).bit_length())
        self.step += 1
        self.counts = []

    def totals(self) -> tuple[int, int, int]:
        """The last decode step's counts over its sparse layers (reads them from the device)."""
        return tuple(sum(int(c[i]) for c in self.counts) for i in range(3)) if self.counts else (0, 0, 0)

    def hit_rate(self) -> float | None:
        """Of the pages the last decode step chose, the share already cached (None before any step)."""
        hits, chosen, _ = self.totals()
        return hits / chosen if chosen else None
