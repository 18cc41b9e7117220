"""Sketch decode: each KV head reads the pages that hold the most of its query group's estimated attention mass.

A low-bit copy of each sparse layer's post-RoPE keys (the sketch) stays in GPU memory: per token and KV head,
symmetric integer codes (int4, two a byte or eight a word, or int8) and one float32 scale. Each decode step scores
every stored token with the real query, q . k_hat / sqrt(D), turns each query head's scores into an estimated
softmax over the stored tokens, sums that mass over the head's GQA group and over each page, and lets every KV head
read page 0 and its pages of largest estimated mass (the rule of `quest.top_pages`). The Pallas kernel reduces the
scores to each page's log-sum-exp in registers (`pallas_kernels.sketch_page_lse`); the softmax over pages is
small. With exact keys this is the true-mass oracle of `bench/eval_oracle.py`, which keeps full attention's NIAH
score at Quest's budgets.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jax_offload.config import SKETCH_DTYPES
from jax_offload.precision import step_jit, sum_last_axis
from jax_offload.sparse.quest import candidate_count, scores_each
from jax_offload.tensor_parallel import TensorParallel

# The largest code of each sketch dtype: codes lie in [-qmax, qmax], symmetric around zero.
SKETCH_QMAX = dict(zip(SKETCH_DTYPES, (7, 127)))


def check_sketch_dtype(dtype: str) -> str:
    if dtype not in SKETCH_QMAX:
        raise ValueError(f"sketch_dtype {dtype!r} is unknown; valid: {', '.join(SKETCH_DTYPES)}.")
    return dtype


def quantize_keys(k: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
    """Keys k [..., D] -> (codes int8 [..., D] in [-qmax, qmax], scale float32 [...]): k ~= codes * scale, the
    scale the largest |k| of the token's head over qmax (a zero key gets scale 0 and codes 0)."""
    qmax = SKETCH_QMAX[check_sketch_dtype(dtype)]
    kf = k.astype(jnp.float32)
    scale = jnp.max(jnp.abs(kf), axis=-1) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    codes = jnp.clip(jnp.round(kf / safe), -qmax, qmax).astype(jnp.int8)
    return codes, scale


_PAIR_SHIFTS = np.arange(4, dtype=np.uint32) * 4


def pack_codes(codes: jax.Array, dtype: str, words: bool = False) -> jax.Array:
    """int8 codes [..., D] -> what the sketch stores (`pallas_kernels.sketch`'s layouts): int8 as they are; int4 as
    bytes, uint8 [..., D / 2] (byte j: channel j in the low nibble, channel j + D / 2 in the high one, each in 4-bit
    two's complement), or with `words` as uint32 [..., D / 8] of eight sign-magnitude codes each."""
    if check_sketch_dtype(dtype) == "int8":
        return codes
    d = codes.shape[-1]
    if not words:
        half = d // 2
        lo, hi = (codes[..., :half].astype(jnp.uint8) & 0xF), (codes[..., half:].astype(jnp.uint8) & 0xF)
        return lo | (hi << 4)
    if d % 8:
        raise ValueError(f"int4 words pack a head dim that is a multiple of 8; got {d}")
    c = codes.astype(jnp.int32).reshape(*codes.shape[:-1], 2, d // 8, 4)  # [..., low/high, word, k]
    mag, sign = jnp.abs(c).astype(jnp.uint32), (c < 0).astype(jnp.uint32)
    k = jnp.asarray(_PAIR_SHIFTS)
    fields = ((mag[..., 0, :, :] << k) | (sign[..., 0, :, :] << ((15 + k) % 32))
              | (mag[..., 1, :, :] << (16 + k)) | (sign[..., 1, :, :] << ((31 + k) % 32)))
    return jnp.sum(fields, axis=-1, dtype=jnp.uint32)  # the fields' bits are disjoint


def unpack_codes(packed: jax.Array, dtype: str) -> jax.Array:
    """The inverse of `pack_codes` (the int4 layout told by the dtype) -> int8 codes [..., D]."""
    if check_sketch_dtype(dtype) == "int8":
        return packed
    if packed.dtype == jnp.uint8:
        lo = ((packed & 0xF) ^ 8).astype(jnp.int8) - 8  # sign extension of a 4-bit two's complement value
        hi = ((packed >> 4) ^ 8).astype(jnp.int8) - 8
        return jnp.concatenate([lo, hi], axis=-1)
    words = packed[..., None]
    k = jnp.asarray(_PAIR_SHIFTS)

    def code(mag_bit, sign_bit):
        mag = ((words >> mag_bit) & 7).astype(jnp.int8)
        return jnp.where((words >> sign_bit) & 1 == 1, -mag, mag).reshape(*packed.shape[:-1], 4 * packed.shape[-1])

    return jnp.concatenate([code(k, (15 + k) % 32), code(16 + k, (31 + k) % 32)], axis=-1)


def token_scores(q: jax.Array, packed: jax.Array, scale: jax.Array, dtype: str) -> jax.Array:
    """Estimated attention logits of every sketched token: q [Hkv, G, D], packed codes [Hkv, T, width], scales
    [Hkv, T] -> float32 [Hkv, G, T] = (q . codes) * scale / sqrt(D). The codes are small integers, exact in any
    float dtype, so q . codes is q's products summed in float32."""
    codes = unpack_codes(packed, dtype).astype(q.dtype)
    dots = jnp.einsum("hgd,htd->hgt", q, codes, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)
    return dots * (scale[:, None, :] / math.sqrt(q.shape[-1]))


def page_lse(scores: jax.Array, page_size: int) -> jax.Array:
    """scores [Hkv, G, T] (T a multiple of page_size) -> float32 [Hkv, G, T / page_size]: the log-sum-exp of each
    page's tokens (what the Pallas kernel computes without writing the scores)."""
    hkv, g, t = scores.shape
    return jax.nn.logsumexp(scores.reshape(hkv, g, t // page_size, page_size), axis=-1)


def mass_of_pages(lse: jax.Array, num_pages: jax.Array) -> jax.Array:
    """Per KV head the estimated attention mass of each page: page log-sum-exps [Hkv, G, P] -> float32 [Hkv, P],
    each query head's softmax over the first `num_pages` pages (its tokens' softmax, summed per page) summed over
    the group; a page past num_pages gets 0. `num_pages`: a scalar, or one per KV head [Hkv]. The sums are fixed
    trees (`sum_last_axis`), so a head's mass has the same bits however many heads are scored together and however
    many page slots past num_pages there are."""
    visible = jnp.arange(lse.shape[-1]) < jnp.reshape(num_pages, (-1, 1, 1))
    s = jnp.where(visible, lse, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    share = e / jnp.maximum(sum_last_axis(e), 1e-30)
    return sum_last_axis(jnp.moveaxis(share, 1, -1))[..., 0]


def page_mass(scores: jax.Array, num_pages: jax.Array, page_size: int) -> jax.Array:
    """Estimated attention mass [Hkv, P] of each of the first `num_pages` pages from token scores [Hkv, G, T]."""
    return mass_of_pages(page_lse(scores, page_size), num_pages)


def to_page_layout(x: jax.Array, page_size: int) -> jax.Array:
    """[Hkv, T, ...] -> the stored layout [Hkv, page_size, T / page_size, ...]: token j of page p at [:, j, p]."""
    hkv, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(hkv, t // page_size, page_size, *x.shape[2:]), 2, 1)


def from_page_layout(x: jax.Array) -> jax.Array:
    """The inverse of `to_page_layout`."""
    hkv, page_size, p = x.shape[:3]
    return jnp.moveaxis(x, 1, 2).reshape(hkv, p * page_size, *x.shape[3:])


@dataclasses.dataclass(frozen=True)
class SketchScore:
    """The sketch's page score inside the decode step (static under jit): a layer's metadata is (codes, scales)."""

    dtype: str
    page_size: int

    def page_scores(self, impl: str, q: jax.Array, meta: tuple[jax.Array, jax.Array], num_pages: jax.Array,
                    num_candidates: int) -> jax.Array:
        """q [Hq, D] -> the estimated mass of the first `num_candidates` pages, float32 [Hkv, num_candidates]
        (only the first `num_pages` hold keys). With the Pallas kernels one kernel unpacks the codes in registers
        and returns each page's log-sum-exp; the jnp path unpacks them in memory and scores every token."""
        packed, scale = meta
        qg = q.reshape(packed.shape[0], -1, q.shape[-1])
        return mass_of_pages(self._page_lse(impl, qg, packed, scale, num_candidates), num_pages)

    def requests_page_scores(self, impl: str, q: jax.Array, meta: tuple[jax.Array, jax.Array],
                             page_tables: tuple[jax.Array, ...], num_pages: tuple[jax.Array, ...],
                             num_candidates: int, block_pages: int) -> jax.Array:
        """`page_scores` of requests sharing a store, stacked on the KV-head axis: q [requests, Hq, D], `page_tables`
        [num_candidates] each (its pages' store pages, in its order: whole store blocks of `block_pages` pages, then
        page 0), `num_pages` a scalar each -> float32 [requests * Hkv, num_candidates], each request's rows the bits
        it gets alone. With the Pallas kernels one kernel call scores all requests' pages, in runs of whole pages (a
        store block, or the largest run dividing both it and num_candidates). Where a run is whole 64-page tiles the
        kernel is told where each tile lies in the store and reads it there (`tile_starts`: on Hopper nothing is
        gathered; an H200 step of 8 x 64K spent 4.1 ms in that gather); otherwise the runs are gathered end to end
        first. The jnp path scores request by request (XLA's CPU dots choose their order by shape)."""
        hkv = meta[0].shape[0]
        if impl != "pallas":
            return scores_each(self, impl, q, meta, page_tables, num_pages, num_candidates)
        run = math.gcd(block_pages, num_candidates)
        tables = jnp.stack(page_tables)
        qg = q.reshape(q.shape[0], hkv, -1, q.shape[-1])
        bits = 4 if self.dtype == "int4" else 8
        if run % pallas_kernels.SKETCH_TILE_PAGES == 0:
            # Each 64-page tile lies in one run of consecutive store pages, from its first page's: the kernel reads
            # it there (padding pages: page 0, never counted).
            starts = tables[:, ::pallas_kernels.SKETCH_TILE_PAGES]
            lse = pallas_kernels.sketch_page_lse_requests(qg, *meta, bits=bits, num_pages=num_candidates,
                                                          tile_starts=starts.reshape(-1))
        else:
            runs = (tables[:, ::run] // run).reshape(-1)  # padding pages (page 0): run 0, never counted

            def gathered(m):  # [Hkv, page_size, slots, ...] -> [Hkv, page_size, requests * num_candidates, ...]
                by_run = m.reshape(*m.shape[:2], m.shape[2] // run, run, *m.shape[3:])
                return by_run[:, :, runs].reshape(*m.shape[:2], runs.shape[0] * run, *m.shape[3:])

            lse = pallas_kernels.sketch_page_lse_requests(qg, *(gathered(m) for m in meta), bits=bits,
                                                          num_pages=num_candidates)
        return mass_of_pages(lse.reshape(-1, *lse.shape[2:]), jnp.repeat(jnp.stack(num_pages), hkv))

    def _page_lse(self, impl, qg, packed, scale, num_candidates: int) -> jax.Array:
        """Each page's log-sum-exp of its tokens' estimated logits, float32 [Hkv, G, num_candidates], for q
        [Hkv, G, D] of one request."""
        if impl == "pallas":
            return pallas_kernels.sketch_page_lse(qg, packed, scale, bits=4 if self.dtype == "int4" else 8,
                                                  num_pages=num_candidates)
        packed, scale = packed[:, :, :num_candidates], scale[:, :, :num_candidates]
        scores = token_scores(qg, from_page_layout(packed), from_page_layout(scale), self.dtype)
        return page_lse(scores, self.page_size)

    def gather(self, meta: tuple[jax.Array, jax.Array], pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A layer's sketch of `pages` [n], in that order (one request's pages of a shared store)."""
        return tuple(m[:, :, pages] for m in meta)


class KeySketch:
    """The key sketch of every sparse layer, on the GPU, for up to `num_tokens` tokens per layer, in the page layout
    of `to_page_layout` (P = num_tokens / page_size): codes [Hkv, page_size, P, width] in `pack_codes`' layout
    (int8; int4 bytes, or int4 words where the Hopper kernel will score them), scales [Hkv, page_size, P] float32."""

    def __init__(self, layers: list[int], num_tokens: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: str, tp: TensorParallel, words: bool = False):
        """Under tensor parallelism each device keeps the sketch of its own KV heads."""
        self.layers, self.page_size, self.dtype = set(layers), page_size, check_sketch_dtype(dtype)
        self.words = words and dtype == "int4"
        self.num_slots = num_tokens // page_size
        if dtype == "int8":
            width, code_dtype = head_dim, jnp.int8
        else:
            width, code_dtype = (head_dim // 8, jnp.uint32) if self.words else (head_dim // 2, jnp.uint8)
        pages = (num_kv_heads, page_size, self.num_slots)
        self.codes = {l: tp.zeros((*pages, width), code_dtype, 0) for l in layers}
        self.scales = {l: tp.zeros(pages, jnp.float32, 0) for l in layers}
        self.nbytes = sum(x.nbytes for d in (self.codes, self.scales) for x in d.values())
        self.scorer = SketchScore(dtype, page_size)

    def candidates(self, num_pages: int, budget_pages: int) -> int:
        return candidate_count(self.num_slots, num_pages, budget_pages)

    def metadata(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self.codes[layer], self.scales[layer]

    def record(self, layer: int, block_index: int, kv: jax.Array) -> None:
        """Sketches the keys of a block kv [2, block_size, Hkv, D] being written as block `block_index` of `layer`."""
        if layer in self.layers:
            first = np.int32(block_index * kv.shape[1] // self.page_size)
            self.codes[layer], self.scales[layer] = _record(self.codes[layer], self.scales[layer], kv, first,
                                                            self.dtype, self.page_size, self.words)


@functools.partial(step_jit, static_argnums=(4, 5, 6), donate_argnums=(0, 1))
def _record(codes: jax.Array, scales: jax.Array, kv: jax.Array, first_page: jax.Array, dtype: str, page_size: int,
            words: bool):
    new_codes, new_scales = quantize_keys(kv[0].transpose(1, 0, 2), dtype)
    new_codes = to_page_layout(pack_codes(new_codes, dtype, words), page_size)
    return (jax.lax.dynamic_update_slice(codes, new_codes, (0, 0, first_page, 0)),
            jax.lax.dynamic_update_slice(scales, to_page_layout(new_scales, page_size), (0, 0, first_page)))
