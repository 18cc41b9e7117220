"""The model over a paged KV pool: batched prefill of packed prompts, one compiled decode step for the whole
model and batch (sampling included), and the host swap of preempted sequences' blocks.

The pool is a tuple over layers of [num_blocks, block_size, Hkv, D] arrays for K and one for V (with an fp8 or
int8 KV cache, `QuantizedKV` pairs of 8-bit values and their scales, dequantized inside the decode kernel), all
donated to every step, so each layer's pages reach the attention kernel as a whole buffer: slicing a layer out of one
stacked array would copy it, and one array over all layers would pass 2^31 elements (int32 offsets in the
kernel) at real sizes. A block id means the same block in every layer.

Prefill packs the prompts of a step one after another into one row (each starting at a multiple of PACK_ALIGN)
and runs the causal kernel with each query's first visible key at its prompt's start, so no prompt sees another
and no compute goes to padding them to a common length. The row is padded to a length bucket, so a few programs
serve every step; the scheduler's token budget counts that padded row, what is really computed. A prompt longer
than the budget is prefilled chunk by chunk: each chunk attends to the prompt's keys already in the pool (its
blocks gathered per layer, a copy far smaller than the chunk's compute) and then causally to its own; the running
sequences' next tokens ride in the same step, as rows after the chunk's (`_chunk_layer`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.attention import (
    chunk_attention,
    embed_tokens,
    paged_decode_attention,
    prefill_attention,
    split_qkv,
)
from jax_offload.buckets import cache_bucket, layer_group_size, prompt_bucket
from jax_offload.config import ModelConfig
from jax_offload.kv import kv_cache_dtype as kv_format
from jax_offload.kv.host_store import available_host_bytes
from jax_offload.models import decoder
from jax_offload.models.params import LayerParams, ModelParams
from jax_offload.precision import step_jit
from jax_offload.sampling import Drawn, TokenLogprobs, drawn_logprobs, drawn_to_host, sample_token
from jax_offload.serving.sequence import Sequence
from jax_offload.tensor_parallel import TensorParallel, host_memory_kind
from pallas_kernels import max_decode_splits


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes steps are padded to: powers of two up to the first >= max_num_seqs. The same set for every
    limit in a power-of-two range, so engines with different limits share their compiled steps."""
    return [1 << i for i in range((max_num_seqs - 1).bit_length() + 1)]


# Packed prompts start at multiples of this: the prefill kernels take keys 128 at a time (the Hopper kernel; Triton
# 64, 32 in float32; the jnp twin 16), so a prompt's keys then fall into the same tiles as when it runs alone and its
# results carry the same bits.
PACK_ALIGN = 128


def packed_length(num_tokens: int) -> int:
    """Room a prompt of num_tokens takes in a packed prefill row."""
    return -(-num_tokens // PACK_ALIGN) * PACK_ALIGN


def prefill_bucket(total: int) -> int:
    """Padded length of a packed prefill row holding `total` tokens: the one-request buckets from 64 up (shorter
    buckets save little compute and would multiply the shapes to compile)."""
    return max(prompt_bucket(total), 64)


def kv_block_bytes(cfg: ModelConfig, dtype: jnp.dtype, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block of K and V over all layers, stored as `kv_cache_dtype` says."""
    vector = kv_format.bytes_per_vector(kv_cache_dtype, cfg.head_dim, dtype)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * vector


def default_num_blocks(cfg: ModelConfig, dtype: jnp.dtype, block_size: int, max_num_seqs: int, max_model_len: int,
                       max_num_batched_tokens: int, gpu_memory_utilization: float, num_devices: int = 1,
                       batch_invariant: bool = False, kv_cache_dtype: str = "auto", reserve_bytes: int = 0) -> int:
    """As many blocks as `gpu_memory_utilization` of what JAX's allocator may use leaves after the weights, a
    step's activations, a prefill chunk's gathered prefix, (batch-invariant) the decode splits' states of one
    layer and `reserve_bytes` per device, and no more than max_num_seqs full-length sequences need; each of
    `num_devices` holds its share of a block's KV heads. Without device memory statistics (CPU) a quarter of the
    free host memory is the budget."""
    wanted = max_num_seqs * -(-max_model_len // block_size)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        itemsize = jnp.dtype(dtype).itemsize
        # A chunk step carries a decode row per running sequence (padded to the largest batch) beside the chunk.
        activations = _activation_bytes(cfg, max_num_batched_tokens + batch_buckets(max_num_seqs)[-1], itemsize)
        logits = 4 * max_num_seqs * cfg.vocab_size * 4  # float32 logits, scaled copy, noise, sort
        prefix = 2 * max_model_len * cfg.num_kv_heads * cfg.head_dim * itemsize  # one layer's, gathered for a chunk
        # Batch-invariant decode: every split's float32 (o, lse) of one layer.
        splits = (max_decode_splits(max_model_len) * max_num_seqs * cfg.num_heads * (cfg.head_dim + 1) * 4
                  if batch_invariant else 0)
        budget = (stats["bytes_limit"] * gpu_memory_utilization - stats["bytes_in_use"] - activations - logits
                  - prefix - splits - reserve_bytes)
    else:
        budget = available_host_bytes() / 4
    per_device = kv_block_bytes(cfg, dtype, block_size, kv_cache_dtype) // num_devices
    return int(max(min(wanted, budget // per_device), 0))


class SamplingBatch(NamedTuple):
    """Per-row sampling knobs (on the device; they travel packed, `sampling_batch`); token n of a request is drawn
    with fold_in(its own key, n), so no row's draw depends on which other requests share the step."""

    temperature: jax.Array  # float32 [B]
    top_p: jax.Array  # float32 [B]
    top_k: jax.Array  # int32 [B]
    keys: jax.Array  # uint32 [B, 2]
    steps: jax.Array  # int32 [B]: tokens the request has generated so far
    ban_eos: jax.Array  # bool [B]: the request has fewer than min_tokens, so EOS may not be drawn


class Draws(NamedTuple):
    """What a step's sampler computes (static: each kind compiles once). `kind`: "greedy" when no row samples,
    "tempered" when some do but none filters by top-p / top-k, else "filtered"; `logprobs`: whether some row asks
    for log-probabilities; `banned`: the EOS ids, when some row may not draw them yet (else empty)."""

    kind: str
    logprobs: bool = False
    banned: tuple[int, ...] = ()


# The knobs travel as one int32 array [B, KNOB_COLUMNS], one host-to-device copy instead of six: temperature and
# top_p as their float32 bits, top_k, the key's two uint32 words, the tokens generated so far, whether EOS is banned.
_TEMPERATURE, _TOP_P, _TOP_K, _KEY, _STEP, _BAN_EOS = 0, 1, 2, 3, 5, 6
KNOB_COLUMNS = 7


def sampling_batch(seqs: list[Sequence], size: int) -> tuple[np.ndarray, Draws]:
    """Knobs of `seqs` packed [size, KNOB_COLUMNS] (`unpack_sampling`), padded with greedy rows, and what the step's
    sampler computes: a greedy batch compiles no sampler, only a filtering row pays for the vocabulary sort, and
    only a row asking for them for log-probabilities."""
    temperature = np.zeros(size, np.float32)
    top_p = np.ones(size, np.float32)
    knobs = np.zeros((size, KNOB_COLUMNS), np.int32)
    knobs[:, _TOP_K] = -1
    for row, seq in enumerate(seqs):
        p = seq.params
        temperature[row], top_p[row], knobs[row, _TOP_K] = p.temperature, p.top_p, p.top_k
        knobs[row, _KEY:_KEY + 2] = np.asarray(seq.key, np.uint32).view(np.int32)
        knobs[row, _STEP] = seq.num_generated
        knobs[row, _BAN_EOS] = seq.num_generated < p.min_tokens
    knobs[:, _TEMPERATURE] = temperature.view(np.int32)
    knobs[:, _TOP_P] = top_p.view(np.int32)
    hot = temperature > 0
    kind = ("greedy" if not hot.any() else "filtered" if (hot & ((top_p < 1) | (knobs[:, _TOP_K] > 0))).any()
            else "tempered")
    banned = tuple(sorted(seqs[0].eos_ids)) if seqs and knobs[:, _BAN_EOS].any() else ()
    draws = Draws(kind, any(seq.params.logprobs is not None for seq in seqs), banned)
    return knobs, draws


def unpack_sampling(knobs: jax.Array) -> SamplingBatch:
    """The SamplingBatch of packed knobs [B, KNOB_COLUMNS], bit for bit the values `sampling_batch` packed."""
    def bits(column: int | slice, dtype) -> jax.Array:
        return jax.lax.bitcast_convert_type(knobs[:, column], dtype)

    return SamplingBatch(bits(_TEMPERATURE, jnp.float32), bits(_TOP_P, jnp.float32), knobs[:, _TOP_K],
                         bits(slice(_KEY, _KEY + 2), jnp.uint32), knobs[:, _STEP], knobs[:, _BAN_EOS] != 0)


# A decode step's inputs in one int32 array [batch, STEP_COLUMNS + max_blocks_per_seq], so one host-to-device copy
# carries them all: on an H200 the four arrays' copy and the six sampling arrays' took ~0.65 and ~0.3 ms of an 8B
# step's host time (bench/results/runs/h200_invariant_price/k_chunks/). Per row: the token, the row of the previous
# step's draw that holds it (-1: the token column), the length with it, the sampling knobs, then the block table.
_TOKEN, _PREVIOUS_ROW, _SEQ_LEN = 0, 1, 2
_KNOBS = slice(3, 3 + KNOB_COLUMNS)
STEP_COLUMNS = 3 + KNOB_COLUMNS


def decode_step_inputs(seqs: list[Sequence], size: int, max_blocks: int, previous_row: dict[int, int]
                       ) -> tuple[np.ndarray, Draws]:
    """The packed inputs [size, STEP_COLUMNS + max_blocks] of a decode step over `seqs` (padding rows: length 0,
    greedy), and its draws; a sequence whose token is still on the device is read from the previous draw's row
    previous_row[id(seq)]."""
    knobs, draws = sampling_batch(seqs, size)
    packed = np.zeros((size, STEP_COLUMNS + max_blocks), np.int32)
    packed[:, _PREVIOUS_ROW] = -1
    packed[:, _KNOBS] = knobs
    for row, seq in enumerate(seqs):
        if seq.num_pending:
            packed[row, _PREVIOUS_ROW] = previous_row[id(seq)]
        else:
            packed[row, _TOKEN] = seq.last_token
        packed[row, _SEQ_LEN] = seq.num_cached + 1
        packed[row, STEP_COLUMNS:STEP_COLUMNS + len(seq.block_table)] = seq.block_table
    return packed, draws


def steps_suit(seqs: list[Sequence]) -> bool:
    """Whether `seqs` may decode several steps in one program: plain greedy or tempered draws (what such a
    program's draw computes), no log-probabilities, and EOS allowed (each request's min_tokens reached)."""
    return all(seq.params.logprobs is None and seq.num_generated >= seq.params.min_tokens
               and (seq.params.temperature == 0 or (seq.params.top_p >= 1 and seq.params.top_k <= 0)) for seq in seqs)


def sample(logits: jax.Array, knobs: jax.Array, draws: Draws) -> Drawn:
    """Token ids [B] (and their log-probabilities if `draws.logprobs`) from float32 logits [B, vocab] and packed
    knobs [B, KNOB_COLUMNS] (`sampling_batch`). Greedy rows take the argmax; rows with top-p or top-k run
    `sample_token` itself; other rows draw from the tempered logits directly with the same key (sample_token would
    drop at most the float rounding mass of its cumulative sum), which spares them a vocabulary sort. `draws` leaves
    out what no row needs: the sort over [B, vocab] logits costs more than the rest of a large decode step's
    sampling. Each row takes its own kind of draw whatever `draws` is, so a row's token never depends on the other
    rows."""
    s = unpack_sampling(knobs)
    raw = logits
    if draws.banned:
        banned = jnp.zeros(logits.shape[-1], bool).at[jnp.asarray(draws.banned)].set(True)
        logits = jnp.where(s.ban_eos[:, None] & banned, -jnp.inf, logits)
    tokens = _draw(logits, s, draws.kind)
    return Drawn(tokens, drawn_logprobs(raw, tokens) if draws.logprobs else None)


def _draw(logits: jax.Array, s: SamplingBatch, kind: str) -> jax.Array:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if kind == "greedy":
        return tokens
    keys = jax.vmap(jax.random.fold_in)(s.keys, s.steps)
    hot = s.temperature > 0
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    plain = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    tokens = jnp.where(hot, plain, tokens)
    if kind == "tempered":
        return tokens
    filtered = hot & ((s.top_p < 1) | (s.top_k > 0))
    # The plain function under the jit: a nested jit may not carry the step's compiler options.
    drawn = jax.vmap(sample_token.__wrapped__)(logits, s.temperature, s.top_p, s.top_k, keys)
    return jnp.where(filtered, drawn, tokens)


def _write_kv(pool, slots: jax.Array, kv: jax.Array, kv_cache_dtype: str):
    """Writes kv [..., Hkv, D] (as the layer computed it) into one layer's pool at `slots` [...] (block *
    block_size + offset; -1 writes nothing), encoded as the pool stores it."""
    values = kv_format.values_of(pool)
    stored = kv_format.encode(kv_cache_dtype, kv.reshape(-1, *kv.shape[-2:]), values.dtype)
    index = jnp.where(slots >= 0, slots, values.shape[0] * values.shape[1]).reshape(-1)

    def write(pool, new):
        rows = pool.reshape(-1, *pool.shape[2:]).at[index].set(new, mode="drop")
        return rows.reshape(pool.shape)

    return jax.tree.map(write, pool, stored)


def _pool_prefix(pool, blocks: jax.Array, dtype) -> jax.Array:
    """The keys (or values) of one sequence's pool blocks `blocks`, in order: [1, n * block_size, Hkv, D] in
    `dtype`."""
    return kv_format.dequantize(jax.tree.map(lambda p: p[blocks].reshape(1, -1, *p.shape[2:]), pool), dtype)


def own_prefill_bytes(cfg: ModelConfig, dtype: jnp.dtype, max_model_len: int, num_devices: int = 1) -> int:
    """Device memory a one-request prefill of a max_model_len prompt takes beside the pool, per device
    (`Sequence.own_prefill` in GPU memory): its K and V caches of every layer and one layer's activations over the
    whole prompt."""
    itemsize = jnp.dtype(dtype).itemsize
    tokens = max(cache_bucket(max_model_len), prompt_bucket(max_model_len))
    caches = 2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * itemsize // num_devices
    return caches + _activation_bytes(cfg, tokens, itemsize)


def _activation_bytes(cfg: ModelConfig, rows: int, itemsize: int) -> int:
    """One layer's activations over `rows` tokens: hidden states, q, k, v and the MLP's intermediates."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return rows * (6 * cfg.hidden_size + 2 * qkv + 4 * cfg.intermediate_size) * itemsize


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",), donate_argnums=(4, 5))
def _prefill_layers(cfg: ModelConfig, impl: str, layers: tuple[LayerParams, ...], x: jax.Array, k_pools: tuple,
                    v_pools: tuple, inv_freq: jax.Array, positions: jax.Array, starts: jax.Array, slots: jax.Array,
                    tp: TensorParallel | None = None):
    """Consecutive layers over packed prompts x [1, T, hidden] (token t at `positions` in its prompt, which starts
    at `starts`); writes their K, V into each layer's pool at `slots` (-1: padding). Each layer the same arithmetic
    as the one-request engine's `prefill_layer_in_device`."""
    k_out, v_out = [], []
    for layer, k_pool, v_pool in zip(layers, k_pools, v_pools):
        layer = layer.for_prompt_tokens()
        q, k, v = split_qkv(cfg, tp, layer, x, positions, inv_freq)
        o, _ = prefill_attention(impl, q, k, v, causal=True, kv_start=starts, tp=tp)
        k_out.append(_write_kv(k_pool, slots, k, layer.kv_cache_dtype))
        v_out.append(_write_kv(v_pool, slots, v, layer.kv_cache_dtype))
        x = decoder.attention_output_and_mlp(cfg, layer, x, o)
    return x, tuple(k_out), tuple(v_out)


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",), donate_argnums=(4, 5))
def _chunk_layer(cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                 inv_freq: jax.Array, positions: jax.Array, slots: jax.Array, starts: jax.Array | None,
                 prefix_blocks: jax.Array | None, prefix_len: jax.Array, chunk_len: jax.Array, tables: jax.Array,
                 seq_lens: jax.Array, tp: TensorParallel | None = None):
    """One layer over a chunk of one prompt (the first T rows of x [1, T + B, hidden]) and the new token of each of B
    running sequences (the last B rows; block tables [B, n], lengths [B] counting the token, 0 for padding): the
    projections and the MLP over every row at once (batch-invariant: each part's apart, in its phase's order), each
    part's attention as its own step would run it. The chunk: a prompt's first (`prefix_blocks` None) as
    `_prefill_layers` runs a prompt (`starts`: its rows' first keys), a later one over the prompt's first prefix_len
    tokens in the pool's `prefix_blocks` (ids past them are padding: read, then masked) and then causally over its
    own chunk_len; the tokens as `_decode_step` runs them.
    `positions`, `slots` [1, T + B] (slot -1: nothing written)."""
    t = positions.shape[1] - seq_lens.shape[0]
    prompt_layer = layer.for_prompt_tokens()

    def by_phase(fn, x: jax.Array, *args) -> tuple | jax.Array:
        """fn(layer, x, *args) over all rows, or, batch-invariant, over the chunk's rows and the decode rows apart,
        each in its phase's matmul order (args: row-aligned arrays [1, T + B, ...])."""
        if not layer.batch_invariant:
            return fn(layer, x, *args)
        parts = (fn(prompt_layer, x[:, :t], *(a[:, :t] for a in args)),
                 fn(layer, x[:, t:], *(a[:, t:] for a in args)))
        if isinstance(parts[0], tuple):
            return tuple(jnp.concatenate(p, axis=1) for p in zip(*parts))
        return jnp.concatenate(parts, axis=1)

    q, k, v = by_phase(lambda lay, x, pos: split_qkv(cfg, tp, lay, x, pos, inv_freq), x, positions)
    if prefix_blocks is not None:  # the prefix as earlier steps left it, read before this step writes
        k_prefix, v_prefix = (_pool_prefix(pool, prefix_blocks, x.dtype) for pool in (k_pool, v_pool))
    k_pool = _write_kv(k_pool, slots, k, layer.kv_cache_dtype)
    v_pool = _write_kv(v_pool, slots, v, layer.kv_cache_dtype)
    if prefix_blocks is None:
        o_chunk, _ = prefill_attention(impl, q[:, :t], k[:, :t], v[:, :t], causal=True, kv_start=starts, tp=tp)
    else:
        o_chunk = chunk_attention(impl, q[:, :t], k[:, :t], v[:, :t], k_prefix, v_prefix, prefix_len, chunk_len, tp=tp)
    o_tokens = paged_decode_attention(impl, q[0, t:], k_pool, v_pool, tables, seq_lens, tp, layer.batch_invariant)
    o = jnp.concatenate([o_chunk.astype(x.dtype), o_tokens.astype(x.dtype)[None]], axis=1)
    return by_phase(lambda lay, x, o: decoder.attention_output_and_mlp(cfg, lay, x, o), x, o), k_pool, v_pool


def sample_last(cfg: ModelConfig, params: ModelParams, hidden: jax.Array, index: jax.Array,
                knobs: jax.Array, draws: Draws, live: int | None = None) -> Drawn:
    """The next token of each request b, from its last token's hidden state: hidden [..., hidden_size] with the
    leading axes flattened, at index[b]; `live`: how many of the rows are requests (the others pad the draw to a
    compiled size; default all). Two programs: the logits compile once per hidden shape, the draw (the decode
    step's) once per batch size and kind of draw, so a prefill of a length met before never compiles for a new mix
    of greedy and sampled requests (on a GPU, seconds of a server's time to first token)."""
    row_by_row = live is not None and jax.default_backend() == "cpu" and not params.batch_invariant
    return _sample(_last_logits(cfg, params, hidden, index, np.int32(live) if row_by_row else None), knobs, draws)


@functools.partial(step_jit, static_argnums=0)
def _last_logits(cfg: ModelConfig, params: ModelParams, hidden: jax.Array, index: jax.Array,
                 live: jax.Array | None) -> jax.Array:
    """float32 logits [B, vocab] of the hidden states [..., hidden_size] at flattened rows index[b]. With `live`
    (the CPU, whose LM head multiplies a batch row by row, `decoder._dot`): only rows b < live are multiplied, each
    as that product multiplies it, and the padding rows' logits are 0 (a prefill's draw padded to 256 rows cost
    ~1.4 s of each prompt's prefill of the default model on the 2-core CPU, bench/results/runs/cpu_step_api_prefill/).
    """
    h = hidden.reshape(-1, hidden.shape[-1])[index]
    if live is None:
        return decoder.logits(cfg, params, h)
    return jax.lax.fori_loop(0, live, lambda b, out: out.at[b].set(decoder.logits(cfg, params, h[b])),
                             jnp.zeros((h.shape[0], cfg.vocab_size), jnp.float32))


def _model_step(cfg: ModelConfig, impl: str, params: ModelParams, k_pool: tuple[jax.Array, ...],
                v_pool: tuple[jax.Array, ...], inv_freq: jax.Array, tokens: jax.Array, packed: jax.Array,
                tp: TensorParallel | None = None) -> tuple[jax.Array, tuple, tuple]:
    """The whole model for one token per sequence: tokens [B] at positions seq_len - 1 (rows with seq_len 0 are
    padding); the lengths and block tables from the step's packed inputs (`decode_step_inputs`). Returns the
    float32 logits [B, vocab] and the updated pools."""
    seq_lens, tables = packed[:, _SEQ_LEN], packed[:, STEP_COLUMNS:]
    block_size = jax.tree.leaves(k_pool[0])[0].shape[1]
    positions = jnp.maximum(seq_lens - 1, 0)
    block = tables[jnp.arange(tables.shape[0]), positions // block_size]
    slots = jnp.where(seq_lens > 0, block * block_size + positions % block_size, -1)
    x = decoder.embed(params, tokens[:, None])
    k_out, v_out = [], []
    for layer, k_pages, v_pages in zip(params.layers, k_pool, v_pool):
        q, k, v = split_qkv(cfg, tp, layer, x, positions[:, None], inv_freq)
        k_out.append(_write_kv(k_pages, slots, k[:, 0], layer.kv_cache_dtype))
        v_out.append(_write_kv(v_pages, slots, v[:, 0], layer.kv_cache_dtype))
        o = paged_decode_attention(impl, q[:, 0], k_out[-1], v_out[-1], tables, seq_lens, tp, params.batch_invariant)
        x = decoder.attention_output_and_mlp(cfg, layer, x, o[:, None])
    return decoder.logits(cfg, params, x[:, 0]), tuple(k_out), tuple(v_out)


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",), donate_argnums=(3, 4, 6, 7))
def _decode_step(cfg: ModelConfig, impl: str, params: ModelParams, k_pool: tuple[jax.Array, ...],
                 v_pool: tuple[jax.Array, ...], inv_freq: jax.Array, tokens: jax.Array, packed: jax.Array,
                 tp: TensorParallel | None = None) -> tuple[jax.Array, tuple, tuple, jax.Array, jax.Array]:
    """`_model_step` as a program: the logits, the pools, and its input slots handed back (`stage_step_inputs`).
    The draw is a program of its own (`_sample_step`): the model's compiles once per batch size, whatever the
    requests' sampling asks (a server's mix of greedy, sampled and log-probability requests)."""
    logits, k_pool, v_pool = _model_step(cfg, impl, params, k_pool, v_pool, inv_freq, tokens, packed, tp)
    return logits, k_pool, v_pool, tokens, packed


@functools.partial(step_jit, static_argnums=(0, 1, 8), static_argnames=("tp",), donate_argnums=(3, 4, 6, 7))
def _decode_steps(cfg: ModelConfig, impl: str, params: ModelParams, k_pool: tuple[jax.Array, ...],
                  v_pool: tuple[jax.Array, ...], inv_freq: jax.Array, tokens: jax.Array, packed: jax.Array,
                  steps: int, tp: TensorParallel | None = None
                  ) -> tuple[Drawn, tuple, tuple, jax.Array, jax.Array]:
    """`steps` decode steps in one program, each the model (`_decode_step`) and its draw, the next taking the
    tokens the last drew: one launch for several tokens, where a small batch's step waits for the host's launch
    (bench/results/runs/h200_dispatch/, "Several decode steps a launch"). Step k runs each live row at its length
    plus k and draws its token with the request's key folded with its count plus k, so the tokens are those of
    `steps` single steps. One program a batch size for greedy and tempered rows alike (a tempered draw takes a
    greedy row's argmax): they run where the device waits for the host anyway, and each compiles for seconds.
    Returns the draws stacked [steps, B], the pools and the input slots (`stage_step_inputs`)."""
    live = packed[:, _SEQ_LEN] > 0

    def one(carry, k):
        step_tokens, k_pool, v_pool = carry
        at = packed.at[:, _SEQ_LEN].add(jnp.where(live, k, 0)).at[:, _KNOBS.start + _STEP].add(k)
        logits, k_pool, v_pool = _model_step(cfg, impl, params, k_pool, v_pool, inv_freq, step_tokens, at, tp)
        drawn = sample(logits, at[:, _KNOBS], Draws("tempered"))
        return (drawn.tokens, k_pool, v_pool), drawn

    (_, k_pool, v_pool), drawn = jax.lax.scan(one, (tokens, k_pool, v_pool), jnp.arange(steps, dtype=jnp.int32))
    return drawn, k_pool, v_pool, tokens, packed


@functools.partial(step_jit, static_argnums=2)
def _sample(logits: jax.Array, knobs: jax.Array, draws: Draws) -> Drawn:
    return sample(logits, knobs, draws)


@functools.partial(step_jit, static_argnums=2)
def _sample_step(logits: jax.Array, packed: jax.Array, draws: Draws) -> Drawn:
    """`_sample` with the knobs of a decode step's packed inputs (sliced in the program, not by a launch of its own)."""
    return sample(logits, packed[:, _KNOBS], draws)


@jax.jit
def feed_step_tokens(drawn: jax.Array, packed: jax.Array) -> jax.Array:
    """Input tokens of a decode step from its packed rows [B, ...] (the decode step's `decode_step_inputs`, the
    offloaded step's rows): row r takes drawn[p] (a token still on the device) where its previous draw's row p
    (column 1) is >= 0, else its token (column 0). Draws of several steps [steps, B] give their last step's."""
    drawn = drawn[-1] if drawn.ndim == 2 else drawn
    rows = packed[:, _PREVIOUS_ROW]
    return jnp.where(rows >= 0, drawn[jnp.maximum(rows, 0)], packed[:, _TOKEN])


@functools.partial(jax.jit, donate_argnums=(0, 1))
def stage_step_inputs(tokens_slot: jax.Array, packed_slot: jax.Array, drawn: jax.Array, packed: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    """A decode step's input tokens (`feed_step_tokens`) and packed inputs, written into its batch size's two slots
    (donated; the step hands them back): every step of a size then reads its inputs at the same addresses, and its
    CUDA graph runs as recorded. Fresh input buffers made XLA update the graph before each launch of a step
    dispatched behind the one before: ~1 ms of the host's ~1.7 ms for a Qwen3-0.6B step on an H200
    (bench/results/runs/h200_dispatch/graph_update/)."""
    return tokens_slot.at[:].set(feed_step_tokens(drawn, packed)), packed_slot.at[:].set(packed)


@functools.lru_cache(maxsize=None)
def device_rows(size: int, sharding: jax.sharding.Sharding) -> jax.Array:
    """0..size-1 on `sharding`'s devices, moved once: a first step's stand-in for the previous draw (its tokens are
    all on the host, so no row reads it), an offloaded step's last-token index."""
    return jax.device_put(np.arange(size, dtype=np.int32), sharding)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def _write_prompt_kv(kv_dtypes: tuple[str, ...], k_pool: tuple, v_pool: tuple, blocks: jax.Array, length: jax.Array,
                     ks: tuple, vs: tuple) -> tuple[tuple, tuple]:
    """Writes a prompt's K and V caches [1, T, Hkv, D] per layer (as a one-request cache holds them; rows from
    `length` on written as zeros) into every layer's pool, block i of the cache into pool block blocks[i] (ids past
    the pool: not written; all distinct), in each layer's KV format. Whole blocks: a scatter of token rows took 18 ms
    for an 8B shape's 32K-token prompt on an H200, of blocks 3.9 (bench/results/runs/h200_kv_reuse/pool_write/)."""
    def write(pool, x, kv_dtype):
        values = kv_format.values_of(pool)
        rows = len(blocks) * values.shape[1]
        x = jnp.pad(x[0], ((0, rows - x.shape[1]), (0, 0), (0, 0)))
        x = jnp.where((jnp.arange(rows) < length)[:, None, None], x, 0)
        stored = kv_format.encode(kv_dtype, x, values.dtype)
        return jax.tree.map(lambda p, new: p.at[blocks].set(new.reshape(-1, *p.shape[1:]), mode="drop",
                                                             unique_indices=True), pool, stored)

    return (tuple(write(pool, k, d) for pool, k, d in zip(k_pool, ks, kv_dtypes)),
            tuple(write(pool, v, d) for pool, v, d in zip(v_pool, vs, kv_dtypes)))


@jax.jit
def _gather_blocks(pools: tuple, blocks: jax.Array):
    """-> [num_layers, len(blocks), block_size, Hkv, D] (each leaf of the stored form)."""
    return jax.tree.map(lambda *layers: jnp.stack([layer[blocks] for layer in layers]), *pools)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_blocks(pools: tuple, blocks: jax.Array, kv) -> tuple:
    """Inverse of `_gather_blocks`; out-of-range block ids write nothing."""
    return tuple(jax.tree.map(lambda pool, stacked: pool.at[blocks].set(stacked[l], mode="drop"), pool, kv)
                 for l, pool in enumerate(pools))


class ModelRunner:
    """Owns the KV pool and runs steps over it; also the scheduler's `KVSwapper` and the block manager's
    `HostTier`. Under tensor parallelism the pool is split on its KV-head axis, each device holding its heads'
    share of every block."""

    def __init__(self, cfg: ModelConfig, params: ModelParams, inv_freq: jax.Array, dtype: jnp.dtype, impl: str,
                 tp: TensorParallel, *, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 swap_space_bytes: int):
        self.cfg, self.params, self.inv_freq, self.impl, self.tp = cfg, params, inv_freq, impl, tp
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = batch_buckets(max_num_seqs)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

        def empty_pool():
            # Made on the mesh, as the steps return them, so that each step compiles once.
            return kv_format.empty(params.kv_cache_dtype, shape, dtype, lambda shape, dtype: tp.zeros(shape, dtype, 2))

        self.k_pool = tuple(empty_pool() for _ in range(cfg.num_layers))
        self.v_pool = tuple(empty_pool() for _ in range(cfg.num_layers))
        self.block_bytes = kv_block_bytes(cfg, dtype, block_size, params.kv_cache_dtype)
        # Swapped blocks [layers, n, block_size, Hkv, D]: each device's heads to and from its own host memory.
        self._host = tp.sharding(3, host_memory_kind())
        self._device = tp.sharding(3, "device")
        self.swap_space_bytes, self.host_bytes_used = swap_space_bytes, 0
        # Each batch size's decode input slots (tokens, packed inputs), passed from step to step (`stage_step_inputs`).
        self._step_slots: dict[int, tuple[jax.Array, jax.Array]] = {}

    def _new_step_slots(self, size: int) -> tuple[jax.Array, jax.Array]:
        """Input slots of a decode step of `size` rows, placed as the step's inputs are."""
        return jax.device_put((np.zeros(size, np.int32), np.zeros((size, STEP_COLUMNS + self.max_blocks_per_seq),
                                                                   np.int32)), self.tp.sharding(None))

    def batch_size(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def prefill_tokens(self, lengths: list[int]) -> int:
        """Tokens a prefill of prompts of these lengths computes, padding included."""
        return prefill_bucket(sum(packed_length(n) for n in lengths))

    def prefill(self, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        """Runs every token of each sequence (none cached yet), packed into one row, and samples the next one. The
        draws are padded to the largest batch, as a chunk's: the last rows' logits and draw compile once per packed
        length, not once more for each number of prompts (on a GPU each new logits shape is autotuned, seconds of a
        server's time to first token; a prefill's 256 rows of logits cost little)."""
        return drawn_to_host(self.prefill_async(seqs), len(seqs))

    def prefill_async(self, seqs: list[Sequence]) -> Drawn:
        """`prefill` without waiting: the draw stays on the device."""
        size = self.buckets[-1]
        x, last = self._prefill_packed(seqs, [s.num_tokens for s in seqs], size)
        return sample_last(self.cfg, self.params, x, self.tp.replicate(last), *self._sampling(seqs, size), len(seqs))

    def own_prefill(self, seq: Sequence) -> list[tuple[int, TokenLogprobs | None]]:
        """Runs a prompt's own prefill (`seq.own_prefill`), writes its K and V into the sequence's blocks and samples
        the next token; none when generated tokens follow (a recompute after a preemption: they run as chunks
        next)."""
        n = len(seq.prompt_ids)
        hidden, k, v, seq.num_cached_tokens, seq.prefill_density = seq.own_prefill(seq.max_len)
        used = -(-n // self.block_size)
        blocks = self.num_blocks + np.arange(-(-k[0].shape[1] // self.block_size), dtype=np.int32)  # past the pool
        blocks[:used] = seq.block_table[:used]
        kv_dtypes = tuple(layer.kv_cache_dtype for layer in self.params.layers)
        self.k_pool, self.v_pool = _write_prompt_kv(kv_dtypes, self.k_pool, self.v_pool, self.tp.replicate(blocks),
                                                    self.tp.replicate(np.int32(n)), tuple(k), tuple(v))
        if seq.output_ids:
            return []
        size = self.buckets[-1]
        last = self.tp.replicate(np.zeros(size, np.int32))
        return drawn_to_host(sample_last(self.cfg, self.params, hidden, last, *self._sampling([seq], size), 1), 1)

    def _prefill_packed(self, seqs: list[Sequence], counts: list[int], size: int) -> tuple[jax.Array, np.ndarray]:
        """Runs the first counts[i] tokens of each sequence packed into one row: the hidden states and the row
        index of each sequence's last token ([size], padded)."""
        ids, positions, starts, slots, rows = self._packed_inputs(seqs, counts)
        last = np.zeros(size, np.int32)
        last[: len(rows)] = rows
        ids, positions, starts, slots = self.tp.replicate((ids, positions, starts, slots))
        x = embed_tokens(self.params.embed, ids)
        layers, group = tuple(self.params.layers), layer_group_size(len(self.params.layers))
        k_out, v_out = (), ()
        for i in range(0, len(layers), group):
            x, k_pools, v_pools = _prefill_layers(self.cfg, self.impl, layers[i:i + group], x,
                                                  self.k_pool[i:i + group], self.v_pool[i:i + group], self.inv_freq,
                                                  positions, starts, slots, tp=self.tp)
            k_out, v_out = k_out + k_pools, v_out + v_pools
        self.k_pool, self.v_pool = k_out, v_out
        return x, last

    def _packed_inputs(self, seqs: list[Sequence], counts: list[int]):
        """(ids, positions, first visible keys, pool slots) [1, L] of the first counts[i] tokens of each sequence
        packed into one row, and each sequence's last row."""
        begins = np.cumsum([0] + [packed_length(n) for n in counts])
        length = prefill_bucket(int(begins[-1]))
        ids = np.zeros((1, length), np.int32)
        positions = np.zeros((1, length), np.int32)
        # A prompt's alignment gap takes its start and the trailing padding starts where it begins: their queries
        # are dropped, and no start past the next prompt's means fewer masked key blocks in the kernel.
        starts = np.full((1, length), begins[-1], np.int32)
        slots = np.full((1, length), -1, np.int32)
        for row, (seq, n, begin) in enumerate(zip(seqs, counts, begins)):
            pos = np.arange(n)
            span = slice(begin, begin + n)
            ids[0, span], positions[0, span], starts[0, begin:begins[row + 1]] = seq.token_ids[:n], pos, begin
            slots[0, span] = self._slots(seq, pos)
        return ids, positions, starts, slots, [int(b + n - 1) for b, n in zip(begins, counts)]

    def _sampling(self, seqs: list[Sequence], size: int) -> tuple[jax.Array, Draws]:
        """`sampling_batch` on the devices that run the step."""
        batch, draws = sampling_batch(seqs, size)
        return self.tp.replicate(batch), draws

    def _slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        """Pool slots (block * block_size + offset) of the sequence's tokens at `positions`."""
        return np.asarray(seq.block_table, np.int32)[positions // self.block_size] * self.block_size \
            + positions % self.block_size

    def prefill_chunk(self, seq: Sequence, start: int, end: int, decodes: list[Sequence] = ()
                      ) -> list[tuple[int, TokenLogprobs | None]]:
        """Runs the sequence's tokens [start, end), the earlier ones already in the pool, and with them the last
        token of each of `decodes` (running sequences whose last tokens are read), one program a layer for both;
        -> the tokens drawn: one for each of `decodes`, then the prompt's next token after its last chunk."""
        if start == 0:  # nothing in the pool yet: the chunk is packed as a prompt of its own
            ids, positions, starts, slots, (last,) = self._packed_inputs([seq], [end])
            prefix_blocks = None
        else:
            ids, positions, slots, prefix_blocks = self._after_inputs(seq, start, end)
            starts, last = None, end - start - 1
        # The tokens' rows and the draws padded to the largest batch: a chunk's step compiles once for any number
        # of running sequences (the padding rows cost little beside a chunk's).
        size = self.buckets[-1]
        tokens, seq_lens, tables = self._decode_inputs(decodes, size)
        token_positions = np.maximum(seq_lens - 1, 0)
        token_slots = np.full(size, -1, np.int32)
        for row, running in enumerate(decodes):
            token_slots[row] = self._slots(running, token_positions[row])
        t = ids.shape[1]
        ids, positions, slots, starts, prefix_blocks, prefix_len, chunk_len, tables, seq_lens = self.tp.replicate((
            np.concatenate([ids, tokens[None]], axis=1), np.concatenate([positions, token_positions[None]], axis=1),
            np.concatenate([slots, token_slots[None]], axis=1), starts, prefix_blocks, np.int32(start),
            np.int32(end - start), tables, seq_lens))
        x = embed_tokens(self.params.embed, ids)
        k_out, v_out = [], []
        for layer, k_pages, v_pages in zip(self.params.layers, self.k_pool, self.v_pool):
            x, k_pages, v_pages = _chunk_layer(self.cfg, self.impl, layer, x, k_pages, v_pages, self.inv_freq,
                                               positions, slots, starts, prefix_blocks, prefix_len, chunk_len,
                                               tables, seq_lens, tp=self.tp)
            k_out.append(k_pages)
            v_out.append(v_pages)
        self.k_pool, self.v_pool = tuple(k_out), tuple(v_out)
        final = end == seq.num_tokens
        drawn = [*decodes, seq] if final else list(decodes)
        if not drawn:
            return []
        rows = np.zeros(size, np.int32)
        rows[: len(decodes)] = t + np.arange(len(decodes))
        if final:
            rows[len(decodes)] = last
        out = sample_last(self.cfg, self.params, x, self.tp.replicate(rows), *self._sampling(drawn, size), len(drawn))
        return drawn_to_host(out, len(drawn))

    def _after_inputs(self, seq: Sequence, start: int, end: int):
        """(ids, positions, pool slots) [1, L] of the sequence's tokens [start > 0, end), and the pool blocks of its
        first `start` tokens, their count padded to a power of two (block 0 fills the rest): few shapes to
        compile."""
        n, bs = end - start, self.block_size
        length = prefill_bucket(n)
        ids = np.zeros((1, length), np.int32)
        ids[0, :n] = seq.token_ids[start:end]
        positions = (start + np.arange(length, dtype=np.int32))[None]
        slots = np.full((1, length), -1, np.int32)
        slots[0, :n] = self._slots(seq, positions[0, :n])
        num_prefix = -(-start // bs)
        prefix_blocks = np.zeros(1 << (num_prefix - 1).bit_length(), np.int32)
        prefix_blocks[:num_prefix] = seq.block_table[:num_prefix]
        return ids, positions, slots, prefix_blocks

    def _decode_inputs(self, seqs: list[Sequence], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(last tokens (0 where still on the device), lengths with them, block tables) [size, ...] of a decode
        step, padded with empty rows."""
        tokens = np.zeros(size, np.int32)
        seq_lens = np.zeros(size, np.int32)
        tables = np.zeros((size, self.max_blocks_per_seq), np.int32)
        for row, seq in enumerate(seqs):
            tokens[row] = 0 if seq.num_pending else seq.last_token
            seq_lens[row] = seq.num_cached + 1
            tables[row, : len(seq.block_table)] = seq.block_table
        return tokens, seq_lens, tables

    def warm_up_sampling(self, decode_steps: int = 1) -> None:
        """Compiles the sampled draws (temperature, and top-p/top-k) at every batch size, and the feeding of one
        batch size's draw (of one step, and of `decode_steps` steps if more) into the next step at every pair of
        sizes; greedy draws compile with the steps that first run them. Inputs are placed as the steps place theirs
        (the same programs, not new ones)."""
        placed = self.tp.sharding(None)
        for size in self.buckets:
            logits = jax.device_put(np.zeros((size, self.cfg.vocab_size), np.float32), placed)
            packed = jax.device_put(decode_step_inputs([], size, self.max_blocks_per_seq, {})[0], placed)
            for kind in ("tempered", "filtered"):
                if size == self.buckets[-1]:  # a prefill's or a chunk's draw: padded to the largest batch
                    knobs = self.tp.replicate(sampling_batch([], size)[0])
                    _sample(logits, knobs, Draws(kind)).tokens.block_until_ready()
                _sample_step(logits, packed, Draws(kind)).tokens.block_until_ready()
            for previous in self.buckets:
                jax.block_until_ready(stage_step_inputs(*self._new_step_slots(size), device_rows(previous, placed),
                                                        packed))
                if decode_steps > 1:  # fed from a draw of several steps
                    rows = jnp.zeros((decode_steps, previous), jnp.int32, device=placed)
                    jax.block_until_ready(stage_step_inputs(*self._new_step_slots(size), rows, packed))

    def decode_async(self, seqs: list[Sequence], previous: tuple[list[Sequence], Drawn] | None = None,
                     steps: int = 1) -> Drawn:
        """Runs each sequence's last token and samples the next one, without waiting: the draw [batch bucket]
        stays on the device. A sequence whose last token is still pending takes it from `previous` (the
        sequences and the result of the step that drew it). With `steps` > 1, that many steps in one program, the
        draws [steps, batch bucket]: the caller has made room for each sequence's `steps` tokens, and no sequence
        asks for log-probabilities, top-p / top-k filtering or a banned EOS (`steps_suit`)."""
        size = self.batch_size(len(seqs))
        previous_row = {id(seq): row for row, seq in enumerate(previous[0])} if previous else {}
        packed, draws = decode_step_inputs(seqs, size, self.max_blocks_per_seq, previous_row)
        # Placed as a previous step's draw is (on one device too, where `tp.replicate` leaves host arrays), and the
        # tokens go through feed_step_tokens even with nothing to take from a previous step: the step's tokens are
        # then always an array of one kind and placement, and the step compiles once per batch size, not once more
        # for host tokens (a server's steps after each admission).
        placed = self.tp.sharding(None)
        packed = jax.device_put(packed, placed)
        slots = self._step_slots.pop(size, None) or self._new_step_slots(size)
        tokens, packed = stage_step_inputs(*slots, previous[1].tokens if previous else device_rows(size, placed),
                                           packed)
        if steps > 1:
            drawn, self.k_pool, self.v_pool, *slots = _decode_steps(
                self.cfg, self.impl, self.params, self.k_pool, self.v_pool, self.inv_freq, tokens, packed, steps,
                tp=self.tp)
            self._step_slots[size] = tuple(slots)
            return drawn
        logits, self.k_pool, self.v_pool, *slots = _decode_step(
            self.cfg, self.impl, self.params, self.k_pool, self.v_pool, self.inv_freq, tokens, packed, tp=self.tp)
        self._step_slots[size] = tuple(slots)
        return _sample_step(logits, slots[1], draws)

    # ---- KVSwapper --------------------------------------------------------------------------------------------

    def _swap_blocks(self, seq: Sequence) -> tuple[int, int]:
        """(blocks holding the sequence's KV, that count padded to a power of two, at most the pool, so copies
        compile rarely)."""
        n = -(-seq.num_cached // self.block_size)
        return n, min(1 << (n - 1).bit_length(), self.num_blocks)

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host_bytes_used + self._swap_blocks(seq)[1] * self.block_bytes <= self.swap_space_bytes

    def swap_out(self, seq: Sequence) -> None:
        """Copies the sequence's KV blocks to host memory (its pool blocks are freed by the scheduler next)."""
        n, padded = self._swap_blocks(seq)
        blocks = np.zeros(padded, np.int32)  # padding reads block 0; those rows are never written back
        blocks[:n] = seq.block_table[:n]
        seq.host_kv = self._copy_to_host(blocks)
        self.host_bytes_used += padded * self.block_bytes

    def swap_in(self, seq: Sequence) -> None:
        """Writes the host copy back into the sequence's newly allocated blocks."""
        n, padded = self._swap_blocks(seq)
        blocks = np.full(padded, self.num_blocks, np.int32)  # out of range: padding rows are dropped
        blocks[:n] = seq.block_table[:n]
        self._copy_from_host(seq.host_kv, blocks)
        seq.host_kv = None
        self.host_bytes_used -= padded * self.block_bytes

    def _copy_to_host(self, blocks: np.ndarray):
        """A host copy (K, V) of the pool blocks `blocks`, every layer."""
        return jax.device_put((_gather_blocks(self.k_pool, blocks), _gather_blocks(self.v_pool, blocks)), self._host)

    def _copy_from_host(self, kv, blocks: np.ndarray) -> None:
        """Writes a `_copy_to_host` copy into the pool blocks `blocks` (out-of-range ids write nothing)."""
        k, v = jax.device_put(kv, self._device)
        self.k_pool = _scatter_blocks(self.k_pool, blocks, k)
        self.v_pool = _scatter_blocks(self.v_pool, blocks, v)

    # ---- HostTier: prefix-cache blocks evicted from the pool ----------------------------------------------------

    def save(self, block: int) -> tuple[jax.Array, jax.Array]:
        """A host copy of one pool block's KV (every layer, K and V)."""
        return self._copy_to_host(np.array([block], np.int32))

    def load(self, saved: tuple[jax.Array, jax.Array], block: int) -> None:
        """Writes a `save`d copy into pool block `block`."""
        self._copy_from_host(saved, np.array([block], np.int32))

    def drop(self, seq: Sequence) -> None:
        """Lets go of a swapped-out sequence's host copy (one aborted while swapped); its pool blocks are the block
        manager's to free."""
        if seq.host_kv is not None:
            seq.host_kv = None
            self.host_bytes_used -= self._swap_blocks(seq)[1] * self.block_bytes
