"""Quest (Tang et al., ICML 2024) for offloaded decode: per page of keys, the elementwise min and max key on the
GPU; a query's bound sum_d max(q_d min_d, q_d max_d) over a page bounds every q . k in it, and each KV head reads
only the pages with the highest bounds (the query heads of a GQA group combined by the max of their bounds).

The bounds are of post-RoPE keys, computed when a block is written to the host store; they are a 1/page_size
fraction of the KV they describe and stay on the GPU, so choosing pages costs no transfer.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jax_offload.kv.host_store import PAGE_UNIT
from jax_offload.precision import step_jit
from jax_offload.tensor_parallel import TensorParallel


def page_bounds(k: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Keys k [T, Hkv, D] (T a multiple of page_size) -> elementwise (min, max) [Hkv, T / page_size, D]."""
    t, hkv, d = k.shape
    pages = k.reshape(t // page_size, page_size, hkv, d)
    return jnp.min(pages, axis=1).transpose(1, 0, 2), jnp.max(pages, axis=1).transpose(1, 0, 2)


def select_pages(q: jax.Array, kmin: jax.Array, kmax: jax.Array, num_pages: jax.Array, k: int) -> jax.Array:
    """The `k` pages each KV head reads, ascending: page 0 (the attention sink) and the pages with the highest
    bounds among the first `num_pages`. q [Hq, D]; kmin, kmax [Hkv, P, D]. -> int32 [Hkv, k]; when fewer than k
    pages exist, the missing entries are P (past every real page) and sort last. Ties go to the lower page.
    """
    return top_pages(page_scores(q, kmin, kmax), num_pages, k)


def page_scores(q: jax.Array, kmin: jax.Array, kmax: jax.Array) -> jax.Array:
    """Quest's bound of every page, the GQA group's largest -> float32 [Hkv, P]. max(q_d min_d, q_d max_d) is
    q_d max_d where q_d > 0 and q_d min_d otherwise, so the bound is two matrix products, relu(q) . max +
    min(q, 0) . min, with every product exact in float32 (bf16 inputs) and only the sums' order differing."""
    qg = q.reshape(kmin.shape[0], -1, q.shape[-1])  # [Hkv, G, D]
    dot = functools.partial(jnp.einsum, "hgd,hpd->hgp", preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST)
    bound = dot(jnp.maximum(qg, 0).astype(kmax.dtype), kmax) + dot(jnp.minimum(qg, 0).astype(kmin.dtype), kmin)
    return jnp.max(bound, axis=1)


# Rows up to this long are sorted in one shared-memory pass by XLA's GPU sort (which a top-k of more than a few
# entries compiles to); a longer row takes a pass over global memory per merge stage: at 16,384 pages (256K tokens)
# a layer's top-256 took ~66 us on an H100, in stages ~45 (`bench/results/runs/h100_sketch_top_k/`).
TOP_K_CHUNK = 2048


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis, the same values and indices (equal values: the lower index first), in
    stages where a row is long: the top k of each TOP_K_CHUNK-long chunk, then the top k of those. Exact: an
    entry of the row's top k is in its chunk's top k, and equal values keep the order of their indices (chunks
    in order, each chunk's top k stable), so the second stage breaks ties as one top-k over the row would."""
    n = x.shape[-1]
    if n <= TOP_K_CHUNK or n % TOP_K_CHUNK or 4 * k > TOP_K_CHUNK:
        return jax.lax.top_k(x, k)
    chunks = n // TOP_K_CHUNK
    values, index = jax.lax.top_k(x.reshape(*x.shape[:-1], chunks, TOP_K_CHUNK), k)
    index = index + (jnp.arange(chunks, dtype=index.dtype) * TOP_K_CHUNK)[:, None]
    values, index = values.reshape(*x.shape[:-1], chunks * k), index.reshape(*x.shape[:-1], chunks * k)
    values, position = top_k(values, k)
    return values, jnp.take_along_axis(index, position, axis=-1)


def top_pages(score: jax.Array, num_pages: jax.Array, k: int, impl: str = "xla") -> jax.Array:
    """Quest's rule for any page score [Hkv, P]: page 0 and the `k - 1` highest-scoring pages among pages
    1..num_pages - 1, ascending -> int32 [Hkv, k], missing entries P, ties to the lower page. Its own function
    so that another score (an oracle's true attention mass, bench/eval_sparse.py) ranks the very same candidates.
    With the Pallas kernels on a GPU one program a row selects them (`pallas_kernels.top_k_ascending`: no sort);
    otherwise a top-k, then a sort: the same pages."""
    num_slots = score.shape[1]
    page = jnp.arange(num_slots, dtype=jnp.int32)
    score = jnp.where(page == 0, jnp.inf, jnp.where(page < num_pages, score, -jnp.inf))
    if impl == "pallas" and jax.default_backend() == "gpu":
        chosen = pallas_kernels.top_k_ascending(score.astype(jnp.float32), k)
    else:
        chosen = jnp.sort(top_k(score, k)[1], axis=-1)  # equal values: the lower index first
    # Pages past num_pages (fewer pages than k) sort last either way: marked missing where they are.
    return jnp.where(chosen < num_pages, chosen, num_slots).astype(jnp.int32)


def candidate_count(num_slots: int, num_pages: int, budget_pages: int) -> int:
    """How many page slots a step scores: the next power of two covering the written pages and the budget (so the
    choice costs what the context needs, compiled for few sizes), at most every slot."""
    need = max(num_pages, budget_pages, 1)
    return min(num_slots, 1 << (need - 1).bit_length())


def page_rows(pages: jax.Array, num_slots: int, page_size: int, block_size: int) -> jax.Array:
    """Pages [Hkv, k] (index in the layer, or `num_slots` for a missing entry) -> the store's 16-token rows
    [Hkv * k * page_size / PAGE_UNIT] of a "pages" layer, head by head, page by page. Missing pages map to row
    0: gathered like any row and never attended (the caller masks them by length)."""
    hkv, _ = pages.shape
    units_per_page, units_per_block = page_size // PAGE_UNIT, block_size // PAGE_UNIT
    unit = pages[..., None] * units_per_page + jnp.arange(units_per_page, dtype=jnp.int32)  # [Hkv, k, upp]
    block, unit_in_block = unit // units_per_block, unit % units_per_block
    head = jnp.arange(hkv, dtype=jnp.int32)[:, None, None]
    rows = (block * hkv + head) * units_per_block + unit_in_block
    return jnp.where(pages[..., None] < num_slots, rows, 0).reshape(-1)


@dataclasses.dataclass(frozen=True)
class QuestScore:
    """Quest's page score inside the decode step (static under jit): the metadata of a layer is (kmin, kmax)."""

    def page_scores(self, impl: str, q: jax.Array, meta: tuple[jax.Array, jax.Array], num_pages: jax.Array,
                    num_candidates: int) -> jax.Array:
        """q [Hq, D] -> the bound of the first `num_candidates` pages, float32 [Hkv, num_candidates]."""
        kmin, kmax = meta
        return page_scores(q, kmin[:, :num_candidates], kmax[:, :num_candidates])

    def requests_page_scores(self, impl: str, q: jax.Array, meta: tuple[jax.Array, jax.Array],
                             page_tables: tuple[jax.Array, ...], num_pages: tuple[jax.Array, ...],
                             num_candidates: int, block_pages: int) -> jax.Array:
        """`page_scores` of requests q [requests, Hq, D] sharing a store, each over its pages' bounds gathered by its
        page table [num_candidates], stacked on the KV-head axis -> float32 [requests * Hkv, num_candidates].
        Request by request: a batched dot may choose another summation order than one request's (`block_pages`,
        the pages of a store block, is the sketch's concern)."""
        return scores_each(self, impl, q, meta, page_tables, num_pages, num_candidates)

    def gather(self, meta: tuple[jax.Array, jax.Array], pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A layer's bounds of `pages` [n], in that order (one request's pages of a shared store)."""
        return tuple(m[:, pages] for m in meta)


def scores_each(scorer, impl: str, q: jax.Array, meta: tuple[jax.Array, ...], page_tables: tuple[jax.Array, ...],
                num_pages: tuple[jax.Array, ...], num_candidates: int) -> jax.Array:
    """A page policy's `page_scores` of requests q [requests, Hq, D] of a shared store, request by request, each over
    its pages' metadata gathered by its page table (`scorer.gather`), stacked on the KV-head axis."""
    return jnp.concatenate([scorer.page_scores(impl, q[i], scorer.gather(meta, table), n, num_candidates)
                            for i, (table, n) in enumerate(zip(page_tables, num_pages))])


class QuestPages:
    """Page bounds of every sparse layer, on the GPU, for up to `num_pages` pages per layer."""

    scorer = QuestScore()

    def __init__(self, layers: list[int], num_pages: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: jnp.dtype, tp: TensorParallel):
        """Under tensor parallelism each device keeps the bounds of its own KV heads."""
        self.layers, self.page_size, self.num_slots = set(layers), page_size, num_pages
        shape = (num_kv_heads, num_pages, head_dim)
        self.kmin = {l: tp.zeros(shape, dtype, 0) for l in layers}
        self.kmax = {l: tp.zeros(shape, dtype, 0) for l in layers}
        self.nbytes = sum(x.nbytes for d in (self.kmin, self.kmax) for x in d.values())

    def candidates(self, num_pages: int, budget_pages: int) -> int:
        return candidate_count(self.num_slots, num_pages, budget_pages)

    def metadata(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self.kmin[layer], self.kmax[layer]

    def record(self, layer: int, block_index: int, kv: jax.Array) -> None:
        """Bounds of a block kv [2, block_size, Hkv, D] being written as block `block_index` of `layer`."""
        if layer in self.layers:
            first = np.int32(block_index * kv.shape[1] // self.page_size)
            self.kmin[layer], self.kmax[layer] = _record(self.kmin[layer], self.kmax[layer], kv, first,
                                                         self.page_size)


@functools.partial(step_jit, static_argnums=(4,), donate_argnums=(0, 1))
def _record(kmin: jax.Array, kmax: jax.Array, kv: jax.Array, first: jax.Array, page_size: int):
    lo, hi = page_bounds(kv[0], page_size)
    at = (0, first, 0)
    return jax.lax.dynamic_update_slice(kmin, lo.astype(kmin.dtype), at), \
        jax.lax.dynamic_update_slice(kmax, hi.astype(kmax.dtype), at)
