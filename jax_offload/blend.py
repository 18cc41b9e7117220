"""CacheBlend (Yao et al., 2024, arXiv 2405.16444) for prompts made of segments that come back in any order:
retrieved documents, a system prompt, a question.

A prompt given as `Segments([system, doc_a, doc_b, question])` is prefilled from each segment's KV computed alone
(from position 0) the first time its tokens were seen and kept in pinned host memory, keyed by a hash of its
tokens (`SegmentStore`). Keys are kept before RoPE, so placing a segment at a new offset rotates them exactly as
a fresh computation there would. Reused KV lacks the attention to the segments before it; CacheBlend fixes the
tokens where that matters most: layer 0 is computed for every token (its K and V depend only on the token, so
they equal the kept ones), and at layer 1 the reused tokens whose fresh values differ most from the kept ones
(squared difference summed over heads and channels, the seed's `choose_recompute`) are chosen, a
`blend_recompute_ratio` share of them; from layer 1 on only the chosen tokens and the last segment (the question,
always computed) are run through the layers, their fresh K and V replacing the kept ones, the rest reused. Ratio 1
recomputes every token: full prefill. Ratio 0 reuses every kept segment.

Attention is the prefill kernel: over the tokens' own K and V in the layers that compute every token, over the
whole cache from the chosen tokens' positions (`q_positions`) in the others. The blend is a step of the batch
engine for one request (`Sequence.own_prefill`), its KV in GPU memory, then written into the pool; the request
then decodes in the batch with the others.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.attention import embed_tokens, prefill_attention
from jax_offload.buckets import cache_bucket, prompt_bucket
from jax_offload.config import ModelConfig
from jax_offload.kv.content_key import chained_key
from jax_offload.models import decoder
from jax_offload.models.params import LayerParams, ModelParams
from jax_offload.models.rope import cos_sin
from jax_offload.precision import step_jit
from jax_offload.serving.sequence import PromptKV
from jax_offload.tensor_parallel import host_memory_kind


class Segments:
    """A prompt in parts (texts or token-id lists) whose KV may be reused wherever each part appears again; the
    last part is always computed."""

    def __init__(self, parts: Sequence[str | Sequence[int]]):
        if isinstance(parts, str) or not parts:
            raise ValueError("Segments takes a non-empty list of parts (texts or token-id lists).")
        self.parts = list(parts)

    def __repr__(self) -> str:
        return f"Segments({len(self.parts)} parts)"


# Kept layers cross PCIe stacked by this many: few, large copies (1,024 copies of 4 MB moved 4.3 GB in 129 ms on an
# H200, 32 of 128 MB in 81 ms: bench/results/runs/h200_kv_reuse/blend_parts/), while the first group arrives long
# before layer 0's compute ends, so the rest of the move runs under the layers.
KEPT_GROUP = 8


@dataclasses.dataclass
class SegmentKV:
    """One segment of `length` tokens computed alone: its keys before RoPE and its values for layers 1.. (layer 0 is
    computed for every token, so its KV is never reused), stacked KEPT_GROUP layers at a time [G, W, Hkv, D], W its
    length bucket (rows past `length` are padding), so that segments of any length take the same few shapes (and
    compiled programs)."""

    keys: list[jax.Array]
    values: list[jax.Array]
    length: int

    @classmethod
    def from_layers(cls, keys: list[jax.Array], values: list[jax.Array], length: int) -> SegmentKV:
        """From every layer's [1, W, Hkv, D] keys and values, layer 0's left out."""
        groups = range(1, len(keys), KEPT_GROUP)
        return cls(*([_stack(tuple(xs[g:g + KEPT_GROUP])) for g in groups] for xs in (keys, values)), length)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.keys, *self.values))


class SegmentStore:
    """Segments' KV in host memory (pinned where the device has it), least recently used dropped past
    `capacity_bytes`; a segment larger than the whole store is not kept."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[bytes, SegmentKV] = collections.OrderedDict()
        self.bytes_held = 0

    def get(self, key: bytes) -> SegmentKV | None:
        kv = self._entries.get(key)
        if kv is not None:
            self._entries.move_to_end(key)
        return kv

    def put(self, key: bytes, kv: SegmentKV) -> None:
        if key in self._entries or kv.nbytes > self.capacity_bytes:
            return
        while self.bytes_held + kv.nbytes > self.capacity_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes_held -= dropped.nbytes
        self._entries[key] = SegmentKV(*(list(map(_to_host, xs)) for xs in (kv.keys, kv.values)), kv.length)
        self.bytes_held += kv.nbytes

    def __len__(self) -> int:
        return len(self._entries)


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, x.sharding.with_memory_kind(host_memory_kind()))


def _to_device(tree):
    """Every array of `tree` moved to GPU memory, in one call, asynchronously."""
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), tree))


def choose_recompute(v_fresh: jax.Array, v_kept: jax.Array, reused: jax.Array, always: jax.Array,
                     count: jax.Array) -> jax.Array:
    """bool [T]: the `count` reused tokens (`reused` bool [T]) whose fresh values v_fresh [T, Hkv, D] differ most
    from the kept ones (squared difference summed over heads and channels; ties to the earlier token), and the
    tokens computed anyway (`always` bool [T]: the question)."""
    diff = v_fresh.astype(jnp.float32) - v_kept.astype(jnp.float32)
    deviation = jnp.where(reused, jnp.sum(diff * diff, axis=(-2, -1)), -jnp.inf)
    rank = jnp.argsort(jnp.argsort(-deviation, stable=True), stable=True)
    return always | (reused & (rank < count))


@functools.partial(step_jit, static_argnums=(0, 1, 2), donate_argnums=(7, 8))
def _blend_layer(cfg: ModelConfig, impl: str, every_token: bool, layer: LayerParams, x: jax.Array, rows: jax.Array,
                 row_ok: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inv_freq: jax.Array, kv_len: jax.Array):
    """One layer over the computed tokens x [1, S, hidden] at positions `rows` [S] (`row_ok` False: padding):
    their fresh K and V replace the cache's rows [1, T, Hkv, D], then they attend over the cache (`every_token`:
    rows are 0..S-1, all computed: the prefill kernel over their own K and V). Returns (x out, k_cache, v_cache,
    their keys before RoPE, their values)."""
    layer = layer.for_prompt_tokens()
    q, k_pre, v_raw = decoder.project_qkv(cfg, layer, x)
    q, k, v = decoder.place_qkv(layer, q, k_pre, v_raw, rows[None], inv_freq)
    slots = jnp.where(row_ok, rows, k_cache.shape[1])  # padding rows write past the end: dropped
    k_cache = k_cache.at[0, slots].set(k[0].astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[0, slots].set(v[0].astype(v_cache.dtype), mode="drop")
    if every_token:
        o, _ = prefill_attention(impl, q, k, v, causal=True, kv_len=kv_len, out_dtype=jnp.float32)
    else:
        o, _ = prefill_attention(impl, q, k_cache, v_cache, causal=True, kv_len=kv_len, q_positions=rows[None],
                                 out_dtype=jnp.float32)
    return decoder.attention_output_and_mlp(cfg, layer, x, o), k_cache, v_cache, k_pre, v_raw


@functools.partial(step_jit, static_argnums=(0,))
def _choose(cfg: ModelConfig, layer: LayerParams, x: jax.Array, v_kept: jax.Array, reused: jax.Array,
            always: jax.Array, count: jax.Array) -> jax.Array:
    """`choose_recompute` from the layer's fresh values of x [1, W, hidden] against the kept ones [1, W, ...]."""
    return choose_recompute(decoder.project_qkv(cfg, layer.for_prompt_tokens(), x)[2][0], v_kept[0], reused, always,
                            count)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _chosen_rows(chosen: jax.Array, picked: int, size: int) -> tuple[jax.Array, jax.Array]:
    """The positions of the `picked` chosen tokens (bool [W]) ascending, padded to `size` rows with the last one, and
    which rows are real: found on the GPU, so the host queues the layers without waiting for the choice."""
    rows = jnp.flatnonzero(chosen, size=size, fill_value=0).astype(jnp.int32)
    row_ok = jnp.arange(size) < picked
    return jnp.where(row_ok, rows, rows[picked - 1]), row_ok


@jax.jit
def _stack(layers: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.concatenate(layers)


def _assemble(parts: tuple[jax.Array, ...], index: jax.Array, offsets: jax.Array, width: int) -> jax.Array:
    """Layer `index` of segments' stacked rows [G, W_i, Hkv, D] placed at `offsets` -> [1, width, Hkv, D]: each
    written after the one before, so the next segment overwrites a segment's padding (rows no segment holds are never
    read as kept: the question is computed, the rest is past the prompt)."""
    out = jnp.zeros((1, width + max(p.shape[1] for p in parts), *parts[0].shape[2:]), parts[0].dtype)
    for i, part in enumerate(parts):
        layer = jax.lax.dynamic_index_in_dim(part, index, keepdims=True)
        out = jax.lax.dynamic_update_slice(out, layer, (0, offsets[i], 0, 0))
    return out[:, :width]


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _kept_layer(layer: LayerParams, parts: tuple[tuple[jax.Array, jax.Array], ...], index: jax.Array,
                offsets: jax.Array, inv_freq: jax.Array, width: int, cache_len: int, with_values: bool):
    """A layer's K and V caches [1, cache_len, Hkv, D] holding the kept segments' keys (before RoPE, rotated here to
    their new positions) and values, in one program; and the kept values [1, width, Hkv, D] when `with_values` (the
    choice compares them with fresh ones), else None."""
    k_pre, v = (_assemble(tuple(pair[j] for pair in parts), index, offsets, width) for j in (0, 1))
    cos, sin = cos_sin(inv_freq, jnp.arange(width, dtype=jnp.int32)[None], k_pre.dtype)
    pad = ((0, 0), (0, cache_len - width), (0, 0), (0, 0))
    caches = tuple(jnp.pad(c, pad) for c in decoder.stored_kv(layer, k_pre, v, cos, sin))
    return (*caches, v if with_values else None)


class _KeptSegments:
    """The kept segments' KV, moved to the GPU in one call before any layer is queued, each layer assembled as its
    turn comes. XLA starts a transfer only once the compute queued before it has run (an H200 took 83 ms for a
    matmul chain, 82 ms for the move, 156 ms for the chain with the move queued after it and 90 ms with the move
    queued first: bench/results/runs/h200_kv_reuse/blend_parts/), so queued first, the move runs under layer 0's
    compute and the later groups under the layers before them."""

    def __init__(self, segments: list[SegmentKV], width: int):
        self._width = width
        self._offsets = jnp.asarray(np.cumsum([0] + [kv.length for kv in segments[:-1]]), jnp.int32)
        self._indices = [jnp.asarray(np.int32(j)) for j in range(KEPT_GROUP)]
        # A call per group: the arrays of one `device_put` are ready together, so the first layers would wait for all.
        groups = range(len(segments[0].keys))
        self._moved = [_to_device([(kv.keys[g], kv.values[g]) for kv in segments]) for g in groups]

    def layer(self, layer: LayerParams, i: int, inv_freq: jax.Array, cache_len: int, with_values: bool
              ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Layer i's (>= 1) K and V caches and, when `with_values`, its kept values (`_kept_layer`)."""
        group, index = divmod(i - 1, KEPT_GROUP)
        return _kept_layer(layer, tuple(self._moved[group]), self._indices[index], self._offsets, inv_freq,
                           self._width, cache_len, with_values)


class BlendRunner:
    """Prefills `Segments` prompts (module docstring) into the one-request KV cache of a `DeviceRunner`."""

    def __init__(self, cfg: ModelConfig, params: ModelParams, inv_freq: jax.Array, dtype: jnp.dtype, impl: str,
                 store: SegmentStore, ratio: float, tag: bytes):
        self.cfg, self.params, self.inv_freq, self.dtype, self.impl = cfg, params, inv_freq, dtype, impl
        self.store, self.ratio, self.tag = store, ratio, tag

    def _run(self, ids: list[int], kept_segments: list[SegmentKV], reused: np.ndarray, cache_len: int
             ) -> tuple[jax.Array, list[jax.Array], list[jax.Array], SegmentKV | None]:
        """The layers over tokens `ids` (positions 0..), the kept segments they start with (none: compute every
        token), `reused` bool [W]. Returns (the last token's hidden state [1, 1, hidden], the caches, and with no
        kept segments the tokens' keys before RoPE and values, to keep)."""
        cfg, n = self.cfg, len(ids)
        width = prompt_bucket(n)
        padded = np.zeros((1, width), np.int32)
        padded[0, :n] = ids
        row_ok = np.arange(width) < n
        always = row_ok & ~reused
        always[n - 1] = True  # the last token's hidden state gives the first output token
        choosable = reused & ~always
        count = math.ceil(self.ratio * int(reused.sum()))
        picked = int(always.sum()) + min(count, int(choosable.sum()))
        # Every small input crosses before the segments' move (`_KeptSegments`): queued after it, they would wait
        # for it on the one host-to-GPU stream, and the layers for them.
        x = embed_tokens(self.params.embed, jnp.asarray(padded))
        rows, row_ok, kv_len = jnp.arange(width, dtype=jnp.int32), jnp.asarray(row_ok), jnp.asarray(np.int32(n))
        choice = tuple(map(jnp.asarray, (choosable, always, np.int32(count))))
        kept = _KeptSegments(kept_segments, width) if kept_segments else None
        shape = (1, cache_len, cfg.num_kv_heads, cfg.head_dim)
        k_caches, v_caches, keys, values = [], [], [], []
        every_token = True
        for i, layer in enumerate(self.params.layers):
            if kept is None or i == 0:
                k_cache, v_cache = jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)
            else:
                k_cache, v_cache, v_kept = kept.layer(layer, i, self.inv_freq, cache_len, with_values=i == 1)
            if kept is not None and i == 1:  # the choice: fresh values of every token against the kept ones
                rows, row_ok = _chosen_rows(_choose(cfg, layer, x, v_kept, *choice), picked, prompt_bucket(picked))
                x = jnp.take(x, rows, axis=1)
                every_token = False
            x, k_cache, v_cache, k_pre, v_raw = _blend_layer(
                cfg, self.impl, every_token, layer, x, rows, row_ok, k_cache, v_cache, self.inv_freq, kv_len)
            k_caches.append(k_cache)
            v_caches.append(v_cache)
            keys.append(k_pre)
            values.append(v_raw)
        last = picked - 1 if kept is not None else n - 1  # the last position is the last row computed
        segment = None if kept is not None else SegmentKV.from_layers(keys, values, n)
        return x[:, last:last + 1], k_caches, v_caches, segment

    def prefill(self, parts: list[list[int]], total_len: int) -> PromptKV:
        """Segments' token ids -> the last token's hidden state [1, 1, hidden], K and V caches per layer of
        cache_bucket(total_len) tokens, prompt tokens whose KV came from the store."""
        ids = [t for part in parts for t in part]
        kept_parts, cached = [], 0
        for part in parts[:-1]:
            key = chained_key(self.tag, part)
            kv = self.store.get(key)
            if kv is None:
                kv = self._run(part, [], np.zeros(prompt_bucket(len(part)), bool), cache_bucket(len(part)))[3]
                self.store.put(key, kv)
            else:
                cached += len(part)
            kept_parts.append(kv)
        cache_len = max(cache_bucket(total_len), prompt_bucket(len(ids)))
        width = prompt_bucket(len(ids))
        reused = np.zeros(width, bool)
        reused[: len(ids) - len(parts[-1])] = True
        hidden, k_caches, v_caches, _ = self._run(ids, kept_parts, reused, cache_len)
        return PromptKV(hidden, k_caches, v_caches, cached)
