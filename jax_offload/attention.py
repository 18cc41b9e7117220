"""Which attention implementation runs, and the jit-compiled layer steps: over a KV cache in GPU memory, a paged
pool, streamed host blocks and chosen pages (the runners compose them).

On a GPU the Pallas kernels run; elsewhere their plain-XLA twins with identical semantics, because
Pallas interpret mode is an emulator meant for checking kernels, far too slow for whole models.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from jax_offload.config import ModelConfig
from jax_offload.kv.host_store import PAGE_UNIT, from_stored_layout, gather_rows, in_device_memory
from jax_offload.kv.kv_cache_dtype import QuantizedKV, dequantize, values_of
from jax_offload.models import decoder
from jax_offload.models.params import LayerParams
from jax_offload.precision import step_jit
from jax_offload.sparse import page_cache, quest, xattention
from jax_offload.sparse.xattention import XAttention
from jax_offload.tensor_parallel import AXIS, TensorParallel
from pallas_kernels import AttentionState

ATTENTION_IMPLS = ("pallas", "xla")

# Head axes of the arrays attention reads and writes, for tensor parallelism (`TensorParallel.per_head`):
HEADS = 2  # q, k, v, o [B, T, H, D]; KV blocks [2, T, Hkv, D]
STATE_HEADS = AttentionState(2, 1, 1)  # acc [B, T, H, D], m and l [B, H, T]
LSE_HEADS = 1  # lse [B, H, T]
MASK_HEADS = 1  # XAttention's block mask [B, H, nqb, nkb]
METADATA_HEADS = 0  # a page policy's metadata: Quest's bounds [Hkv, pages, D], the sketch [Hkv, page_size, pages, ...]
BUFFER_HEADS = 1  # a one-buffer layer of the KV store [num_blocks, Hkv, ...]
POOL_HEADS = 3  # the batch engine's tail pool [slots, 2, block_size, Hkv, D]


def default_attention_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def check_attention_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is unknown; valid: {', '.join(ATTENTION_IMPLS)}.")
    return impl


@step_jit
def embed_tokens(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """token_ids [B, T] -> hidden [B, T, hidden] (takes the table alone: cheaper to pass than all params)."""
    return jnp.take(table, token_ids, axis=0)


def _local(tp: TensorParallel | None, fn, in_axes: tuple, out_axes):
    """`fn` on each device's heads under tensor parallelism; `fn` itself on one device."""
    return fn if tp is None else tp.per_head(fn, in_axes, out_axes)


def split_qkv(cfg: ModelConfig, tp: TensorParallel | None, layer: LayerParams, x: jax.Array, positions: jax.Array,
              inv_freq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v of the layer, pinned to be split by heads (each device computes its own from its wqkv columns)."""
    q, k, v = decoder.attention_inputs(cfg, layer, x, positions, inv_freq)
    return (q, k, v) if tp is None else tp.constrain((q, k, v), HEADS)


def _empty_state(tp: TensorParallel | None, q: jax.Array) -> AttentionState:
    state = pallas_kernels.empty_state(*q.shape)
    return state if tp is None else tp.constrain(state, STATE_HEADS)


def paged_decode_attention(impl: str, q: jax.Array, k_pages: jax.Array | QuantizedKV,
                           v_pages: jax.Array | QuantizedKV, tables: jax.Array, seq_lens: jax.Array,
                           tp: TensorParallel | None = None,
                           batch_invariant: bool = False) -> jax.Array:
    """Decode attention of q [B, Hq, D] over a paged pool [num_blocks, block_size, Hkv, D] (block tables [B, n],
    lengths [B]) -> o [B, Hq, D], each device over its heads. Batch-invariant (Pallas only): o float32 from the
    splits set by each sequence's length folded in key order, the bits of the offloaded decode (`decode_state`); else o
    in q's dtype from splits sized to the batch. An fp8 or int8 pool (`QuantizedKV` pages) is dequantized in the
    kernel."""
    def pool(k_pages, v_pages):
        """(k, v, scale keywords) of a pool in either form."""
        if isinstance(k_pages, QuantizedKV):
            return k_pages.values, v_pages.values, dict(k_scales=k_pages.scales, v_scales=v_pages.scales)
        return k_pages, v_pages, {}

    if impl == "pallas" and batch_invariant:
        def local(q, k_pages, v_pages, tables, seq_lens):
            k, v, scales = pool(k_pages, v_pages)
            state = pallas_kernels.empty_state(q.shape[0], 1, *q.shape[1:])
            o, _ = pallas_kernels.finish_state(
                pallas_kernels.paged_decode_state(q, k, v, tables, seq_lens, state, **scales))
            return o[:, 0]
    else:
        fn = (pallas_kernels.paged_decode_attention_with_lse if impl == "pallas"
              else pallas_kernels.paged_decode_attention_with_lse_xla)

        def local(q, k_pages, v_pages, tables, seq_lens):
            k, v, scales = pool(k_pages, v_pages)
            return fn(q, k, v, tables, seq_lens, **scales)[0]

    return _local(tp, local, (1, HEADS, HEADS, None, None), 1)(q, k_pages, v_pages, tables, seq_lens)


def prefill_attention(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                      q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
                      kv_start: jax.Array | None = None, q_positions: jax.Array | None = None,
                      out_dtype: jnp.dtype | None = None,
                      tp: TensorParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention with LSE of a query chunk [B, T, Hq, D] over keys [B, S, Hkv, D]; o in `out_dtype`
    (default q's dtype; float32 for a partial state that will be merged). `kv_start` [B, T]: each query's first
    visible key (packed sequences); `q_positions` [B, T]: the queries' positions, ascending (queries picked from
    a longer sequence), instead of q_offset + row."""
    fn = pallas_kernels.attention_with_lse if impl == "pallas" else pallas_kernels.attention_with_lse_xla
    names = [name for name, x in (("kv_start", kv_start), ("q_positions", q_positions)) if x is not None]
    rows = [x for x in (kv_start, q_positions) if x is not None]

    def local(q, k, v, q_offset, kv_len, *rows):
        return fn(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len, out_dtype=out_dtype,
                  **dict(zip(names, rows)))

    in_axes = (HEADS, HEADS, HEADS, None, None) + (None,) * len(rows)
    return _local(tp, local, in_axes, (HEADS, LSE_HEADS))(q, k, v, q_offset, kv_len, *rows)


def xattn_select(impl: str, xattn: XAttention, q: jax.Array, k: jax.Array, *, q_offset: int | jax.Array,
                 kv_len: int | jax.Array, tp: TensorParallel | None = None) -> jax.Array:
    """XAttention's block mask [1, Hq, nqb, nkb] (`xattention.select`), each device choosing for its heads."""
    def local(q, k, q_offset, kv_len):
        return xattention.select(xattn, impl, q, k, q_offset=q_offset, kv_len=kv_len)

    return _local(tp, local, (HEADS, HEADS, None, None), MASK_HEADS)(q, k, q_offset, kv_len)


def xattn_attention(impl: str, xattn: XAttention, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                    causal: bool, q_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None,
                    out_dtype: jnp.dtype | None = None, tp: TensorParallel | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """`xattention.attention` -> (o, lse), each device over its heads' chosen blocks."""
    def local(q, k, v, mask, q_offset, kv_len):
        return xattention.attention(xattn, impl, q, k, v, mask, causal=causal, q_offset=q_offset, kv_len=kv_len,
                                    out_dtype=out_dtype)

    return _local(tp, local, (HEADS, HEADS, HEADS, MASK_HEADS, None, None), (HEADS, LSE_HEADS))(
        q, k, v, mask, q_offset, kv_len)


def prompt_attention(impl: str, xattn: XAttention | None, q: jax.Array, k: jax.Array, v: jax.Array,
                     prompt_len: int | jax.Array, tp: TensorParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """Causal attention of a whole (padded) prompt, full or XAttention's blocks -> (o in q's dtype, [selected,
    visible] key blocks as int32 [2]; both 0 for full attention)."""
    if xattn is None:
        o, _ = prefill_attention(impl, q, k, v, causal=True, kv_len=prompt_len, tp=tp)
        return o, jnp.zeros(2, jnp.int32)
    mask = xattn_select(impl, xattn, q, k, q_offset=0, kv_len=prompt_len, tp=tp)
    o, _ = xattn_attention(impl, xattn, q, k, v, mask, causal=True, kv_len=prompt_len, out_dtype=q.dtype, tp=tp)
    return o, xattention.block_counts(mask, 0, prompt_len, xattn.block)


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("xattn", "tp"), donate_argnums=(5, 6))
def prefill_layer_in_device(
    cfg: ModelConfig,
    impl: str,
    layer: LayerParams,
    x: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    prompt_len: jax.Array,
    xattn: XAttention | None = None,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One layer over a whole (padded) prompt x [1, T, hidden]; writes its K, V into the caches [1, S, Hkv, D].
    Also returns the [selected, visible] XAttention block counts."""
    layer = layer.for_prompt_tokens()
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, k, v = split_qkv(cfg, tp, layer, x, positions, inv_freq)
    o, counts = prompt_attention(impl, xattn, q, k, v, prompt_len, tp)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
    return decoder.attention_output_and_mlp(cfg, layer, x, o), k_cache, v_cache, counts


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",), donate_argnums=(5, 6))
def decode_layer_in_device(
    cfg: ModelConfig,
    impl: str,
    layer: LayerParams,
    x: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    position: jax.Array,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer for one new token x [1, 1, hidden] at `position`; appends its K, V to the caches."""
    q, k, v = split_qkv(cfg, tp, layer, x, position.reshape(1, 1), inv_freq)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, position, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, position, 0, 0))
    # The offloaded decode's attention over one block holding every key: both round o once, from the same bits.
    o = attend_and_finish(impl, q, k_cache, v_cache, _empty_state(tp, q), causal=False, kv_len=position + 1, tp=tp)
    return decoder.attention_output_and_mlp(cfg, layer, x, o), k_cache, v_cache


# ---- offloaded KV: a query chunk or token attends block by block ---------------------------------------
# The float32 online-softmax state (pallas_kernels.AttentionState) is carried through the blocks in
# ascending key order, the chunk's own keys (or the decode tail) last, and rounded to the model dtype once,
# in the layer's end step. Prefill kernels (Pallas and jnp alike) continue the state exactly where one call
# over all the keys would be, so chunked prefill gives the in-GPU bits; the Pallas decode cuts the keys into
# splits set by the sequence's whole length (`pallas_kernels.decode_split_lens`: every call on its pieces is told
# it) folded into the state in key order, so blocks of a multiple of DECODE_SPLIT_MAX keys give them too.


def attend(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, state: AttentionState, *, causal: bool,
           kv_len: int | jax.Array | None = None, total_len: jax.Array | None = None,
           tp: TensorParallel | None = None) -> AttentionState:
    """Continues `state` of queries q [B, T, Hq, D] over keys [B, S, Hkv, D]; causal keys are the queries'
    own (positions aligned with the queries), otherwise keys wholly before them. A decode token's keys (T = 1)
    are split by its sequence's whole length `total_len` (None: kv_len, these keys are all of them), so its
    pieces give one call's bits."""
    def local(q, k, v, state, kv_len, total_len):
        if impl == "xla":
            return pallas_kernels.attention_state_xla(q, k, v, state, causal=causal, kv_len=kv_len)
        if q.shape[1] == 1:
            return pallas_kernels.decode_state(q[:, 0], k, v, state, kv_len=kv_len, total_len=total_len)
        return pallas_kernels.attention_state(q, k, v, state, causal=causal, kv_len=kv_len)

    return _local(tp, local, (HEADS, HEADS, HEADS, STATE_HEADS, None, None), STATE_HEADS)(
        q, k, v, state, kv_len, total_len)


def attend_and_finish(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, state: AttentionState, *,
                      causal: bool, kv_len: int | jax.Array | None = None, total_len: jax.Array | None = None,
                      tp: TensorParallel | None = None) -> jax.Array:
    """`attend`, then the final normalisation as the in-GPU kernels do it: o float32 [B, T, Hq, D]."""
    def local(q, k, v, state, kv_len, total_len):
        if impl == "pallas" and q.shape[1] > 1:
            o, _ = pallas_kernels.attention_with_lse(q, k, v, state=state, causal=causal, kv_len=kv_len,
                                                     out_dtype=jnp.float32)
            return o
        o, _ = pallas_kernels.finish_state(attend(impl, q, k, v, state, causal=causal, kv_len=kv_len,
                                                  total_len=total_len))
        return o

    return _local(tp, local, (HEADS, HEADS, HEADS, STATE_HEADS, None, None), HEADS)(
        q, k, v, state, kv_len, total_len)


def chunk_attention(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, k_prefix: jax.Array, v_prefix: jax.Array,
                    prefix_len: jax.Array, chunk_len: jax.Array, tp: TensorParallel | None = None) -> jax.Array:
    """Attention of a prompt chunk's queries q [1, T, Hq, D] over the prompt's earlier keys k_prefix [1, S, Hkv, D]
    (the first prefix_len are real) and then, causally, over the chunk's own keys k [1, T, Hkv, D] (the first
    chunk_len are real), folded in that key order as the offloaded chunked prefill folds its blocks: o float32."""
    state = attend(impl, q, k_prefix, v_prefix, _empty_state(tp, q), causal=False, kv_len=prefix_len, tp=tp)
    return attend_and_finish(impl, q, k, v, state, causal=True, kv_len=chunk_len, tp=tp)


def _split_block(block: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A GPU block [2, block_size, Hkv, D] -> k, v [1, block_size, Hkv, D]."""
    return block[0][None], block[1][None]


def _join_blocks(blocks: tuple, dtype) -> tuple[jax.Array, jax.Array]:
    """Consecutive blocks as the host store keeps them -> k, v [1, n * block_size, Hkv, D] in `dtype` (an 8-bit
    block, packed or not, dequantized in one pass over GPU memory, exactly): one kernel call covers the whole
    group."""
    pages = jax.tree.map(lambda *b: jnp.concatenate(b, axis=1), *blocks) if len(blocks) > 1 else blocks[0]
    return _split_block(dequantize(from_stored_layout(pages), dtype))


@functools.partial(step_jit, static_argnums=(0,), static_argnames=("tp",))
def chunk_begin(
    cfg: ModelConfig, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, start: jax.Array,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array, AttentionState]:
    """q of a prompt chunk x [1, T, hidden] at absolute `start`, its KV block [2, T, Hkv, D], and the empty
    attention state its queries start from."""
    layer = layer.for_prompt_tokens()
    positions = start + jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, k, v = split_qkv(cfg, tp, layer, x, positions, inv_freq)
    return q, jnp.stack([k[0], v[0]]), _empty_state(tp, q)


@functools.partial(step_jit, static_argnums=(0,), static_argnames=("tp",))
def attend_blocks(impl: str, q: jax.Array, blocks: tuple[jax.Array, ...], state: AttentionState,
                  kv_len: jax.Array | None = None, position: jax.Array | None = None,
                  tp: TensorParallel | None = None) -> AttentionState:
    """Continues the state of a chunk's (or a token's) queries over earlier host blocks, all visible, or their
    first `kv_len` keys (the rest pads the group: the kernels never load keys past kv_len). A decode token passes
    its `position` (its sequence's length is position + 1: the split length, `attend`)."""
    k, v = _join_blocks(blocks, q.dtype)
    return attend(impl, q, k, v, state, causal=False, kv_len=kv_len, total_len=None if position is None else
                  position + 1, tp=tp)


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",))
def chunk_end(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, q: jax.Array, kv: jax.Array,
    chunk_len: jax.Array, state: AttentionState, tp: TensorParallel | None = None,
) -> jax.Array:
    """The chunk's causal attention on its own keys, last in key order, then the rest of the layer."""
    k, v = _split_block(kv)
    o = attend_and_finish(impl, q, k, v, state, causal=True, kv_len=chunk_len, tp=tp)
    # the one rounding to the model dtype
    return decoder.attention_output_and_mlp(cfg, layer.for_prompt_tokens(), x, o)


def _decode_inputs(cfg, layer, x, inv_freq, tail, position, tail_len, tp=None):
    q, k, v = split_qkv(cfg, tp, layer, x, position.reshape(1, 1), inv_freq)
    tail = jax.lax.dynamic_update_slice(tail, jnp.stack([k[0], v[0]]).astype(tail.dtype), (0, tail_len, 0, 0))
    return q, tail, _empty_state(tp, q)


@functools.partial(step_jit, static_argnums=(0,), static_argnames=("tp",), donate_argnums=(4,))
def decode_begin(
    cfg: ModelConfig, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, tail: jax.Array,
    position: jax.Array, tail_len: jax.Array, tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array, AttentionState]:
    """For a new token x [1, 1, hidden]: q [1, 1, Hq, D], the GPU tail block [2, block_size, Hkv, D] with
    the token's K, V written at `tail_len`, and the empty attention state."""
    return _decode_inputs(cfg, layer, x, inv_freq, tail, position, tail_len, tp)


def _finish_decode(cfg, impl, layer, x, q, tail, tail_len, position, state, tp=None):
    k, v = _split_block(tail)
    o = attend_and_finish(impl, q, k, v, state, causal=False, kv_len=tail_len + 1, total_len=position + 1, tp=tp)
    return decoder.attention_output_and_mlp(cfg, layer, x, o)  # the one rounding to the model dtype


@functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",))
def decode_end(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, q: jax.Array, tail: jax.Array,
    tail_len: jax.Array, position: jax.Array, state: AttentionState, tp: TensorParallel | None = None,
) -> jax.Array:
    """Attention over the tail (the newest keys, last in key order) of the token at `position`, then the rest of
    the layer."""
    return _finish_decode(cfg, impl, layer, x, q, tail, tail_len, position, state, tp)


# ---- offloaded KV, several requests: one new token each, their tails rows of one GPU pool ----------------
# Each request's host blocks are attended row by row with `attend_blocks`, exactly as one request alone, so the
# rows share only the layer's matmuls and the tail attention, whose kernels compute every row on its own.


def _pooled_begin(
    cfg: ModelConfig, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, tails: jax.Array, slots: jax.Array,
    positions: jax.Array, tail_lens: jax.Array, tp: TensorParallel | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], jax.Array, tuple[AttentionState, ...]]:
    """New tokens x [B, 1, hidden] at `positions` [B], of requests whose tails are rows `slots` [B] of the pool
    tails [S, 2, block_size, Hkv, D] (slot -1: a padding row) -> q [B, 1, Hq, D], each row's own q [1, 1, Hq, D],
    the pool with each token's K, V written at its row's tail length, and each row's empty attention state."""
    q, tails = _pooled_qkv(cfg, layer, x, inv_freq, tails, slots, positions, tail_lens, tp)
    q_rows = tuple(q[r : r + 1] for r in range(q.shape[0]))
    return q, q_rows, tails, tuple(_empty_state(tp, q_row) for q_row in q_rows)


def _pooled_qkv(cfg, layer, x, inv_freq, tails, slots, positions, tail_lens, tp):
    """`_pooled_begin`'s q [B, 1, Hq, D] and pool."""
    q, k, v = split_qkv(cfg, tp, layer, x, positions[:, None], inv_freq)
    rows = jnp.where(slots >= 0, slots, tails.shape[0])
    kv = jnp.stack([k[:, 0], v[:, 0]], axis=1).astype(tails.dtype)  # [B, 2, Hkv, D]
    return q, tails.at[rows, :, tail_lens].set(kv, mode="drop")


pooled_decode_begin = functools.partial(step_jit, static_argnums=(0,), static_argnames=("tp",),
                                        donate_argnums=(4,))(_pooled_begin)


def _pooled_end(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, q: jax.Array, tails: jax.Array,
    slots: jax.Array, tail_lens: jax.Array, positions: jax.Array, states: tuple[AttentionState, ...],
    tp: TensorParallel | None = None,
) -> jax.Array:
    """Each row continues the state its host blocks left over its tail (its newest keys, last in key order; its
    token at `positions`), then the rest of the layer runs for the whole batch."""
    return _pooled_finish(cfg, impl, layer, x, q, tails, slots, tail_lens, positions, _stack_states(states), tp)


def _pooled_finish(cfg, impl, layer, x, q, tails, slots, tail_lens, positions, state, tp):
    """`_pooled_end` with the rows' states as one batch state."""
    o = _attend_tails(impl, q, tails, slots, tail_lens + 1, positions + 1, state, tp)
    return decoder.attention_output_and_mlp(cfg, layer, x, o)  # the one rounding to the model dtype


def _stack_states(states: tuple[AttentionState, ...]) -> AttentionState:
    """Rows' states [1, ...] -> one batch state [rows, ...]."""
    return jax.tree.map(lambda *rows: jnp.concatenate(rows), *states)


def _split_state(state: AttentionState) -> tuple[AttentionState, ...]:
    """A batch state [rows, ...] -> each row's [1, ...]."""
    return tuple(jax.tree.map(lambda x, r=r: x[r:r + 1], state) for r in range(state.acc.shape[0]))


pooled_decode_end = functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",))(_pooled_end)


def _attend_tails(impl: str, q: jax.Array, tails: jax.Array, slots: jax.Array, kv_len: jax.Array,
                  total_lens: jax.Array, state: AttentionState, tp: TensorParallel | None) -> jax.Array:
    """Each row's `state` continued over the first `kv_len` keys of its slot of the tail pool (split by the row's
    whole length, `total_lens`) and finished: o float32 [B, 1, Hq, D]. The Pallas kernel reads the pool in place, a
    slot a page of `paged_decode_state_kv` (same splits and bits as `decode_state` over the slot's block), so a step
    reads the keys its rows hold, not whole blocks."""
    def local(q, tails, state, slots, kv_len, total_lens):
        rows = jnp.maximum(slots, 0)  # a padding row (slot -1) reads slot 0 and is never used
        if impl == "pallas":
            state = pallas_kernels.paged_decode_state_kv(q[:, 0], tails, rows[:, None], kv_len, state,
                                                         total_lens=total_lens)
        else:
            tail = tails[rows]
            state = attend(impl, q, tail[:, 0], tail[:, 1], state, causal=False, kv_len=kv_len)
        return pallas_kernels.finish_state(state)[0]

    return _local(tp, local, (HEADS, POOL_HEADS, STATE_HEADS, None, None, None), HEADS)(
        q, tails, state, slots, kv_len, total_lens)


def _layer_blocks(buffer, dtype) -> tuple[jax.Array, jax.Array]:
    """A one-buffer layer [num_blocks, Hkv, units, 2, PAGE_UNIT, D] -> k, v [1, num_blocks * block_size, Hkv, D]
    in `dtype`."""
    def heads_first(b):
        nb, hkv, units = b.shape[:3]
        return b.swapaxes(0, 1).reshape(hkv, nb * units, *b.shape[3:])

    return _split_block(dequantize(from_stored_layout(jax.tree.map(heads_first, buffer)), dtype))


def _table_rows(buffer, blocks: jax.Array) -> jax.Array:
    """The store rows of a one-buffer layer's `blocks` [n] in that order, per KV head -> [Hkv, n * units]."""
    hkv, units = values_of(buffer).shape[1:3]
    unit = jnp.arange(blocks.shape[0] * units, dtype=jnp.int32)
    head = jnp.arange(hkv, dtype=jnp.int32)[:, None]
    return ((blocks[unit // units])[None] * hkv + head) * units + unit % units


def _all_rows(buffer) -> jax.Array:
    """Every store row of a one-buffer layer [num_blocks, Hkv, units, ...], per KV head in key order -> [Hkv, n]."""
    return _table_rows(buffer, jnp.arange(values_of(buffer).shape[0], dtype=jnp.int32))


@functools.partial(step_jit, static_argnums=(0, 1, 10, 11), static_argnames=("tp",), donate_argnums=(5,))
def dense_stored_layer(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, tail: jax.Array,
    position: jax.Array, tail_len: jax.Array, num_keys: jax.Array, buffer: jax.Array, host, device,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A whole decode layer over a one-buffer layer kept in GPU memory (the dense layers of sketch and Quest decode)
    as one program: attention over its first `num_keys` stored keys, then the tail and the rest of the layer. With
    the Pallas kernels one paged-kernel call reads every KV head's rows in key order from the stored layout (no copy
    of the layer); the jnp path rearranges the layer. `host`, `device`: `HostKVStore.gather_places`.
    -> (hidden, tail with the token's K, V)."""
    q, tail, state = _decode_inputs(cfg, layer, x, inv_freq, tail, position, tail_len, tp)

    def local(q, buffer, state, num_keys):
        if impl == "xla":
            return attend(impl, q, *_layer_blocks(buffer, q.dtype), state, causal=False, kv_len=num_keys)
        return attend_rows(impl, q, buffer, _all_rows(buffer), num_keys, state, host, device, LAYER_SPLIT_KEYS)

    state = _local(tp, local, (HEADS, BUFFER_HEADS, STATE_HEADS, None), STATE_HEADS)(q, buffer, state, num_keys)
    return _finish_decode(cfg, impl, layer, x, q, tail, tail_len, position, state, tp), tail


def _stored_blocks_batch(impl, q, buffer, blocks, num_keys, state, host, device, tp):
    """Requests' attention over a one-buffer layer in GPU memory (a dense layer of sketch and Quest decode) as
    `dense_stored_layer` reads it, each through its block table: for row r of q [R, 1, Hq, D], `blocks[r]`
    [num_blocks] its store blocks in order, then any (read past its `num_keys[r]` keys: masked) -> the batch state
    [R, ...] continued."""
    def local(q, buffer, state, blocks, num_keys):
        if impl == "xla":
            mine = [jax.tree.map(lambda b, t=table: b[t], buffer) for table in blocks]
            return _stack_states(tuple(
                attend(impl, q[i:i + 1], *_layer_blocks(m, q.dtype), s, causal=False, kv_len=n)
                for i, (s, m, n) in enumerate(zip(_split_state(state), mine, num_keys))))
        return attend_rows_batch(impl, q, buffer, tuple(_table_rows(buffer, table) for table in blocks), num_keys,
                                 state, host, device, LAYER_SPLIT_KEYS)

    each = tuple(None for _ in blocks)
    return _local(tp, local, (HEADS, BUFFER_HEADS, STATE_HEADS, each, each), STATE_HEADS)(
        q, buffer, state, blocks, num_keys)


@functools.partial(step_jit, static_argnums=(0, 1, 12, 13), static_argnames=("tp", "executable"),
                   donate_argnums=(5,))
def pooled_stored_decode_layers(
    cfg: ModelConfig, impl: str, layers: tuple[LayerParams, ...], x: jax.Array, inv_freq: jax.Array,
    tails: tuple[jax.Array, ...], slots: jax.Array, positions: jax.Array, tail_lens: jax.Array,
    buffers: tuple, blocks: tuple[jax.Array, ...], num_keys: tuple[jax.Array, ...], host, device,
    tp: TensorParallel | None = None, executable: int = 0,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Consecutive layers kept in GPU memory (the dense layers of sketch and Quest decode) of a batch decode step as
    one program, each as `pooled_decode_begin`, attention over every row's block table (`blocks`, `num_keys`: one
    per row of the batch; a padding row reads no key) and `pooled_decode_end` would run it. As three launches a
    layer they cost the host ~4.4 ms of a step of 8 x 64K on an H200 (0.5-0.9 ms each). `executable`: a key of the
    compiled program alone (see `layer_group_executable`).
    -> (hidden, tails)."""
    tails = list(tails)
    for i, layer in enumerate(layers):
        q, tails[i] = _pooled_qkv(cfg, layer, x, inv_freq, tails[i], slots, positions, tail_lens, tp)
        state = _stored_blocks_batch(impl, q, buffers[i], blocks, num_keys, _empty_state(tp, q), host, device, tp)
        x = _pooled_finish(cfg, impl, layer, x, q, tails[i], slots, tail_lens, positions, state, tp)
    return x, tuple(tails)


def _chosen_pages_rows(impl: str, qs: tuple[jax.Array, ...], scorer, meta: tuple[jax.Array, ...],
                       budget_pages: int, page_size: int, block_size: int, num_candidates: int,
                       num_pages: tuple[jax.Array, ...], page_tables: tuple[jax.Array, ...], buffer, host, device,
                       states: tuple[AttentionState, ...],
                       tp: TensorParallel | None = None) -> tuple[AttentionState, ...]:
    """Requests' attention over the pages each one's policy chooses of a "pages" layer, as `sparse_decode_layer`
    chooses and reads them, in one program: each through its page table, `page_tables` [num_candidates] the store
    page of each of its pages (store block * pages a block + page in it; past its num_pages: any). A request's
    metadata is gathered by its table, so its scores and choice are its own; its chosen pages are read at their
    store pages in its page order. q [1, 1, Hq, D] -> its state continued."""
    return _split_state(_chosen_pages_batch(impl, jnp.concatenate(qs), scorer, meta, budget_pages, page_size,
                                            block_size, num_candidates, num_pages, page_tables, buffer, host, device,
                                            _stack_states(states), tp))


def _chosen_pages_batch(impl, q, scorer, meta, budget_pages, page_size, block_size, num_candidates, num_pages,
                        page_tables, buffer, host, device, state, tp):
    """`_chosen_pages_rows` of the rows q [R, 1, Hq, D] with one batch state [R, ...]."""
    def local(q, meta, buffer, state, num_pages, page_tables):
        pages = _requests_pages(impl, q, scorer, meta, page_tables, num_pages, num_candidates, budget_pages,
                                block_size // page_size)
        rows = _requests_page_rows(pages, page_tables, num_candidates, buffer, page_size, block_size)
        num_keys = tuple(jnp.minimum(n, budget_pages) * page_size for n in num_pages)
        return attend_rows_batch(impl, q, buffer, rows, num_keys, state, host, device)

    meta_heads = tuple(METADATA_HEADS for _ in meta)
    each = tuple(None for _ in num_pages)
    return _local(tp, local, (HEADS, meta_heads, BUFFER_HEADS, STATE_HEADS, each, each), STATE_HEADS)(
        q, tuple(meta), buffer, state, num_pages, page_tables)


def _requests_page_rows(pages, page_tables, num_candidates: int, buffer, page_size: int, block_size: int):
    """Requests' pages stacked on the KV-head axis [requests * Hkv, k] -> their store rows [requests * Hkv, n],
    each through its page table (`_table_page_rows`)."""
    requests = len(page_tables)
    rows = jax.vmap(functools.partial(_table_page_rows, num_candidates=num_candidates, buffer=buffer,
                                      page_size=page_size, block_size=block_size))(
        pages.reshape(requests, -1, pages.shape[-1]), jnp.stack(page_tables))
    return rows.reshape(pages.shape[0], -1)


chosen_pages_attend_rows = functools.partial(step_jit, static_argnums=(0, 2, 4, 5, 6, 7, 11, 12),
                                             static_argnames=("tp",))(_chosen_pages_rows)


def _requests_pages(impl, q, scorer, meta, page_tables, num_pages, num_candidates: int, budget_pages: int,
                    block_pages: int) -> jax.Array:
    """`_chosen_pages` of requests q [R, 1, Hq, D] of a shared store, stacked on the KV-head axis [R * Hkv, k]:
    each one's pages scored as alone by the policy (`requests_page_scores`: pages numbered in its order, store blocks
    of `block_pages` pages), then one top-k for all (a selection, each KV head's row on its own: the choice each gets
    alone)."""
    scores = scorer.requests_page_scores(impl, q[:, 0], meta, page_tables, num_pages, num_candidates, block_pages)
    return quest.top_pages(scores, _per_head(num_pages, meta[0].shape[0]), budget_pages, impl)


def _per_head(values: tuple[jax.Array, ...], hkv: int) -> jax.Array:
    """One int32 scalar per request -> [requests * Hkv, 1], each repeated for its KV heads."""
    return jnp.concatenate([jnp.full((hkv, 1), v, jnp.int32) for v in values])


def _table_page_rows(pages, page_table, num_candidates: int, buffer, page_size: int, block_size: int) -> jax.Array:
    """A request's pages [Hkv, k] (`num_candidates`: missing) -> the store rows of a "pages" layer `buffer` they are
    kept at, through its page table (`quest.page_rows`' order; missing pages: row 0)."""
    store_pages = values_of(buffer).shape[0] * (block_size // page_size)  # past every page: missing
    stored = jnp.where(pages < num_candidates, page_table[jnp.minimum(pages, num_candidates - 1)], store_pages)
    return quest.page_rows(stored, store_pages, page_size, block_size)


def _cached_pages_rows(impl: str, qs: tuple[jax.Array, ...], scorer, meta: tuple[jax.Array, ...],
                       budget_pages: int, page_size: int, block_size: int, num_candidates: int,
                       num_pages: tuple[jax.Array, ...], page_tables: tuple[jax.Array, ...], buffer, kv,
                       maps: page_cache.CacheState, regions: jax.Array, region_slots: int, steps: jax.Array, host,
                       device, states: tuple[AttentionState, ...], tp: TensorParallel | None = None):
    """`chosen_pages_attend_rows` with each request's pages read through its own region of the layer's page cache
    (`kv`, the cache's stored KV; `maps`, every region's maps stacked by region, kv None; `regions` [requests] each
    one's region of `region_slots` slots, `steps` [requests] its decode steps through it): the same bits. Every region
    is filled before any is read (regions are disjoint), so no read of the cache comes between two writes of it.
    -> (states, kv, maps, int32 [requests, 3] of [hits, chosen, pages over PCIe])."""
    state, kv, maps, counts = _cached_pages_batch(
        impl, jnp.concatenate(qs), scorer, meta, budget_pages, page_size, block_size, num_candidates, num_pages,
        page_tables, buffer, kv, maps, regions, region_slots, steps, host, device, _stack_states(states), tp)
    return _split_state(state), kv, maps, counts


def _cached_pages_batch(impl, q, scorer, meta, budget_pages, page_size, block_size, num_candidates, num_pages,
                        page_tables, buffer, kv, maps, regions, region_slots, steps, host, device, state, tp):
    """`_cached_pages_rows` of the rows q [R, 1, Hq, D] with one batch state [R, ...]."""
    def local(q, meta, buffer, kv, maps, num_pages, page_tables, regions, steps, state):
        # One top-k, one plan and one copy for all requests, and one kernel call reading every request's pages.
        pages = _requests_pages(impl, q, scorer, meta, page_tables, num_pages, num_candidates, budget_pages,
                                block_size // page_size)
        kv, reads, maps, counts = _cache_fill(
            impl, pages, num_candidates,
            lambda miss: _requests_page_rows(miss, page_tables, num_candidates, buffer, page_size, block_size),
            kv, maps, regions, region_slots, steps, buffer, page_size, host, device, tp)
        state = attend_rows_batch(impl, q, kv, reads, tuple(jnp.minimum(n, budget_pages) * page_size
                                                            for n in num_pages), state, device, device)
        return state, kv, maps, counts

    meta_heads = tuple(METADATA_HEADS for _ in meta)
    maps_heads = page_cache.CacheState(None, 1, 1, 1)
    each = (None,) * len(num_pages)
    return _local(tp, local, (HEADS, meta_heads, BUFFER_HEADS, BUFFER_HEADS, maps_heads, each, each, None, None,
                              STATE_HEADS),
                  (STATE_HEADS, BUFFER_HEADS, maps_heads, None))(
        q, tuple(meta), buffer, kv, maps, num_pages, page_tables, regions, steps, state)


cached_pages_attend_rows = functools.partial(step_jit, static_argnums=(0, 2, 4, 5, 6, 7, 14, 16, 17),
                                             static_argnames=("tp",), donate_argnums=(11, 12))(_cached_pages_rows)


@functools.partial(step_jit, static_argnums=(0, 1, 9, 11, 12, 13, 14, 21, 23, 24),
                   static_argnames=("tp", "executable"), donate_argnums=(5, 18, 19))
def pooled_pages_decode_layers(
    cfg: ModelConfig, impl: str, layers: tuple[LayerParams, ...], x: jax.Array, inv_freq: jax.Array,
    tails: tuple[jax.Array, ...], slots: jax.Array, positions: jax.Array, tail_lens: jax.Array, scorer,
    metas: tuple, budget_pages: int, page_size: int, block_size: int, num_candidates: int,
    num_pages: tuple[jax.Array, ...], page_tables: tuple[jax.Array, ...], buffers: tuple[jax.Array, ...],
    cache_kvs: tuple[jax.Array, ...] | None, maps: tuple[page_cache.CacheState, ...] | None,
    regions: jax.Array | None, region_slots: int | None, steps: jax.Array | None, host, device,
    tp: TensorParallel | None = None, executable: int = 0,
):
    """Consecutive sparse layers of a batch decode step whose rows are all of one kind (one page-table length, and
    all reading through their regions of the page cache or none) as one program, each layer as its three calls
    would run it: `pooled_decode_begin`, every row's chosen pages (`cached_pages_attend_rows`, with per layer its
    cache's stored KV `cache_kvs` and its regions' `maps`; or `chosen_pages_attend_rows`, all None) and
    `pooled_decode_end`. Every row of the batch takes part (a padding row has no pages). Each launch costs the
    host ~0.5 ms besides its kernels, more than such a layer's GPU time once its pages come from the cache.
    `executable`: a key of the compiled program alone (see `layer_group_executable`).
    -> (hidden, tails, cache_kvs, maps (None without the cache), int32 [layers, rows, 3] counts or None)."""
    tails, kvs, new_maps, counts = list(tails), [], [], []
    for i, layer in enumerate(layers):
        q, tails[i] = _pooled_qkv(cfg, layer, x, inv_freq, tails[i], slots, positions, tail_lens, tp)
        args = (impl, q, scorer, metas[i], budget_pages, page_size, block_size, num_candidates, num_pages,
                page_tables, buffers[i])
        if cache_kvs is None:
            state = _chosen_pages_batch(*args, host, device, _empty_state(tp, q), tp)
        else:
            state, kv, layer_maps, layer_counts = _cached_pages_batch(
                *args, cache_kvs[i], maps[i], regions, region_slots, steps, host, device, _empty_state(tp, q), tp)
            kvs.append(kv)
            new_maps.append(layer_maps)
            counts.append(layer_counts)
        x = _pooled_finish(cfg, impl, layer, x, q, tails[i], slots, tail_lens, positions, state, tp)
    if cache_kvs is None:
        return x, tuple(tails), None, None, None
    return x, tuple(tails), tuple(kvs), tuple(new_maps), jnp.stack(counts)


def _chosen_pages(impl, q, scorer, meta, num_pages, num_candidates, budget_pages) -> jax.Array:
    """The pages [Hkv, budget_pages] each KV head reads, ascending (missing: num_candidates): page 0 and the best of
    the first `num_pages` by the policy's page score (`scorer`, over its metadata `meta` of the layer, scoring the
    first `num_candidates` page slots); see `quest.top_pages`."""
    return quest.top_pages(scorer.page_scores(impl, q[0, 0], meta, num_pages, num_candidates), num_pages,
                           budget_pages, impl)


def _chosen_rows(impl, q, scorer, meta, num_pages, num_candidates, budget_pages, page_size, block_size):
    """The store rows [Hkv, budget_pages * page_size / PAGE_UNIT] of `_chosen_pages`; see `quest.page_rows`."""
    pages = _chosen_pages(impl, q, scorer, meta, num_pages, num_candidates, budget_pages)
    return quest.page_rows(pages, num_candidates, page_size, block_size).reshape(pages.shape[0], -1)


def _page_keys(pages, num_kv_heads: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Gathered pages [Hkv * n, 2, PAGE_UNIT, D], head by head -> k, v [1, n * PAGE_UNIT, Hkv, D] in `dtype`."""
    by_head = jax.tree.map(lambda p: p.reshape(num_kv_heads, -1, *p.shape[1:]), pages)
    return _split_block(dequantize(from_stored_layout(by_head), dtype))


def layer_group_executable(first_layer: int) -> int:
    """The `executable` key of a layer group's program: on a GPU each group its own compiled program, elsewhere one
    for all groups of a shape. XLA runs a program as CUDA graphs and updates a graph whenever the program's buffers
    moved since its last launch; the groups of a step take one compiled program with each group's own weights and
    caches, so every launch updated its graphs (0.6 ms of the host's time a 6-layer sparse launch on an H200, 3 ms of
    a 128K sketch step). A program of its own keeps each group's buffers where they were at its last launch."""
    return first_layer if jax.default_backend() == "gpu" else 0


def reads_rows_in_place(impl: str) -> bool:
    """Whether `attend_rows` reads a pinned buffer's rows in place (the Pallas kernel on a GPU), rather than
    gathering them first."""
    return impl == "pallas" and jax.default_backend() == "gpu"


# Keys per split of the fold in `attend_rows_many`: a request's bits depend on its keys and this alone (not on the
# rows read with it, the tables' width or the programs), so alone or together, from the store or from the page
# cache, it gets the same bits. Chosen pages: 64 keys, a 4,096-key budget in 64 splits per KV head (30 sparse layers
# at 128K on an H200: 0.71 ms from GPU memory against 0.99 in 16 splits, bench/results/runs/h200_sparse_batch/).
# Whole layers in GPU memory (the dense layers of sketch and Quest): 256 keys, timed with it (the in-GPU decode's
# DECODE_SPLIT became 1,024 later; not yet tried here).
CHOSEN_SPLIT_KEYS = 64
LAYER_SPLIT_KEYS = 256
# Programs of one `attend_rows_many` call over all its requests and KV heads (the speed, not the bits).
ROWS_TARGET_PROGRAMS = 1024


def attend_rows(impl: str, q: jax.Array, buffer: jax.Array, rows: jax.Array, num_keys: jax.Array,
                state: AttentionState, host, device, split_keys: int = CHOSEN_SPLIT_KEYS) -> AttentionState:
    """Continues `state` of q [1, 1, Hq, D] over store rows [Hkv, n] of a one-buffer layer `buffer` (each KV
    head's own rows, its first `num_keys` keys): `attend_rows_many` of one request."""
    return attend_rows_many(impl, (q,), buffer, (rows,), (num_keys,), (state,), host, device, split_keys)[0]


def attend_rows_many(impl: str, qs: tuple[jax.Array, ...], buffer: jax.Array,
                     rows: tuple[jax.Array, ...] | jax.Array, num_keys: tuple[jax.Array, ...],
                     states: tuple[AttentionState, ...], host, device,
                     split_keys: int = CHOSEN_SPLIT_KEYS) -> tuple[AttentionState, ...]:
    """Continues each request's `state` of q [1, 1, Hq, D] over its store rows [Hkv, n] of a one-buffer layer
    `buffer` (each KV head's own rows, its first `num_keys` keys; or all requests' rows of one width stacked,
    [requests * Hkv, n]): `attend_rows_batch` of the requests as one batch."""
    return _split_state(attend_rows_batch(impl, jnp.concatenate(qs), buffer, rows, num_keys, _stack_states(states),
                                          host, device, split_keys))


def attend_rows_batch(impl: str, q: jax.Array, buffer: jax.Array, rows: tuple[jax.Array, ...] | jax.Array,
                      num_keys: tuple[jax.Array, ...], state: AttentionState, host, device,
                      split_keys: int = CHOSEN_SPLIT_KEYS) -> AttentionState:
    """Continues the batch state of requests q [R, 1, Hq, D] over each one's store rows of a one-buffer layer
    `buffer` (`attend_rows_many`'s `rows`; its first `num_keys` keys). With the Pallas kernels all requests' rows go
    through one paged-kernel call (each KV head of each request a "sequence"), folded in key order in splits of
    `split_keys` keys: each request gets the bits it gets alone. On a GPU, or with a buffer in GPU memory, the kernel
    reads the rows straight from the buffer: from a pinned host buffer only they cross PCIe and nothing is gathered
    first. The jnp path (and Pallas interpret mode, which cannot read host memory) gathers the rows on the host and
    moves them first."""
    values = values_of(buffer)
    hkv, d = values.shape[1], values.shape[-1]
    requests, _, hq, _ = q.shape
    if impl == "xla":
        each = rows if isinstance(rows, tuple) else tuple(rows[i * hkv:(i + 1) * hkv] for i in range(requests))
        return _stack_states(tuple(
            attend(impl, q[i:i + 1], *_page_keys(gather_rows(buffer, r.reshape(-1), host, device), hkv, q.dtype), s,
                   causal=False, kv_len=n) for i, (r, n, s) in enumerate(zip(each, num_keys, _split_state(state)))))
    if isinstance(rows, tuple):
        width = max(r.shape[1] for r in rows)  # entries past a request's keys are never read
        tables = jnp.concatenate([jnp.pad(r, ((0, 0), (0, width - r.shape[1]))) for r in rows])
    else:
        tables = rows
    if reads_rows_in_place(impl) or in_device_memory(host):
        # each KV head's rows: a "sequence"
        pool = jax.tree.map(lambda b: b.reshape(-1, 2, PAGE_UNIT, 1, b.shape[-1]), buffer)
    else:
        pool = jax.tree.map(lambda p: p[:, :, :, None], gather_rows(buffer, tables.reshape(-1), host, device))
        tables = jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape)
    pool, scales = (pool.values, dict(kv_scales=pool.scales)) if isinstance(pool, QuantizedKV) else (pool, {})
    group = hq // hkv
    state = pallas_kernels.paged_decode_state_kv(
        q.reshape(requests * hkv, group, d), pool, tables, jnp.repeat(jnp.stack(num_keys).astype(jnp.int32), hkv),
        AttentionState(state.acc.reshape(requests * hkv, 1, group, d), state.m.reshape(requests * hkv, group, 1),
                       state.l.reshape(requests * hkv, group, 1)),
        split_len=split_keys, num_programs=-(-ROWS_TARGET_PROGRAMS // (requests * hkv)), **scales)
    return AttentionState(state.acc.reshape(requests, 1, hq, d), state.m.reshape(requests, hq, 1),
                          state.l.reshape(requests, hq, 1))


def _page_choice(cfg, impl, layer, x, inv_freq, tail, position, tail_len, scorer, meta, budget_pages, page_size,
                 block_size, num_candidates, num_pages):
    q, tail, state = _decode_inputs(cfg, layer, x, inv_freq, tail, position, tail_len)
    rows = _chosen_rows(impl, q, scorer, meta, num_pages, num_candidates, budget_pages, page_size, block_size)
    return q, tail, state, rows, jnp.minimum(num_pages, budget_pages) * page_size


@functools.partial(step_jit, static_argnums=(0, 1, 8, 10, 11, 12, 13, 16, 17), static_argnames=("tp",),
                   donate_argnums=(5,))
def sparse_decode_layer(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, tail: jax.Array,
    position: jax.Array, tail_len: jax.Array, scorer, meta: tuple[jax.Array, ...], budget_pages: int,
    page_size: int, block_size: int, num_candidates: int, num_pages: jax.Array, buffer: jax.Array, host, device,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A whole sparse decode layer (Quest or sketch) as one program: the choice of pages among the first
    `num_pages` by the policy's score (`scorer`: `quest.QuestScore` or `sketch.SketchScore`, static; `meta` its
    metadata of the layer, head axis first; only the first `num_candidates` >= num_pages page slots are scored),
    the read of those pages' rows from the pinned `buffer` with attention over them (fewer real keys than the
    budget while the context is short), the tail, and the rest of the layer: one dispatch, no round trip through
    Python between choosing and reading. Under tensor parallelism each device chooses, reads from its own pinned
    shard and attends for its own KV heads. `host`, `device`: where the buffer lives and where pages go
    (`HostKVStore.gather_places`). -> (hidden, tail with the token's K, V)."""
    q, tail, state = _decode_inputs(cfg, layer, x, inv_freq, tail, position, tail_len, tp)

    def local(q, meta, buffer, state, num_pages):
        rows = _chosen_rows(impl, q, scorer, meta, num_pages, num_candidates, budget_pages, page_size, block_size)
        num_keys = jnp.minimum(num_pages, budget_pages) * page_size
        return attend_rows(impl, q, buffer, rows, num_keys, state, host, device)

    meta_heads = tuple(METADATA_HEADS for _ in meta)
    state = _local(tp, local, (HEADS, meta_heads, BUFFER_HEADS, STATE_HEADS, None), STATE_HEADS)(
        q, tuple(meta), buffer, state, num_pages)
    return _finish_decode(cfg, impl, layer, x, q, tail, tail_len, position, state, tp), tail


def _cache_fill(impl, pages, missing, store_rows, kv, maps: page_cache.CacheState, regions, region_slots: int, steps,
                buffer, page_size, host, device, tp):
    """Requests' chosen pages, stacked on the KV-head axis [requests * Hkv, k] (`missing`: none, as
    `_requests_pages` gives them), each planned in its region of the page cache: `maps` every region's maps stacked by
    region (kv None), `regions` [requests] each one's (region r: slots r * region_slots onward of the cache's stored
    KV `kv`; emptied when its request took it: `PageCache.empty_region`), `steps` [requests] its steps through it;
    each KV head's row on its own, so each as alone. Every request's misses are copied in at once from the store rows
    `store_rows(miss pages [requests * Hkv, k])` of `buffer` (request-major). -> (kv, the cache rows of every
    request's chosen pages [requests * Hkv, n] in the order the store read would take them, the regions' maps after
    the step, int32 [requests, 3] of [hits, chosen, pages over PCIe])."""
    requests = regions.shape[0]
    hkv = pages.shape[0] // requests
    # Planned where the maps lie (region r's KV head h: row r * Hkv + h): no gather of the rows, nor writing them back.
    flat = page_cache.CacheState(None, *(m.reshape(-1, m.shape[-1]) for m in maps[1:]))
    use = page_cache.plan(flat, pages, missing, jnp.repeat(steps, hkv)[:, None],
                          (regions[:, None] * hkv + jnp.arange(hkv, dtype=jnp.int32)).reshape(-1))
    total = values_of(kv).shape[0]

    def cache_rows(slots):  # [requests * Hkv, k] -> [requests * Hkv, k * units]
        rows = jax.vmap(page_cache.slot_rows, in_axes=(0, None, None, 0, None))(
            slots.reshape(requests, hkv, -1), region_slots, page_size, regions * region_slots, total)
        return rows.reshape(requests * hkv, -1)

    kv = page_cache.fill(kv, buffer, store_rows(use.miss_pages).reshape(-1), cache_rows(use.miss_slots).reshape(-1),
                         reads_rows_in_place(impl), host, device)
    hits, chosen = (x.reshape(requests, hkv).sum(axis=1) for x in (use.hits, use.chosen))
    # Pages over PCIe: the misses in place; a gather moves every row of the copy's static shape (the budget).
    moved = chosen - hits if reads_rows_in_place(impl) else jnp.full_like(chosen, hkv * pages.shape[1])
    counts = jnp.stack([hits, chosen, moved], axis=1)
    if tp is not None and tp.size > 1:
        counts = jax.lax.psum(counts, AXIS)
    return kv, cache_rows(use.slots), page_cache.CacheState(
        None, *(f.reshape(m.shape) for f, m in zip(use.state[1:], maps[1:]))), counts


def _cached_sparse_decode_layer(
    cfg: ModelConfig, impl: str, layer: LayerParams, x: jax.Array, inv_freq: jax.Array, tail: jax.Array,
    position: jax.Array, tail_len: jax.Array, scorer, meta: tuple[jax.Array, ...], budget_pages: int,
    page_size: int, block_size: int, num_candidates: int, num_pages: jax.Array, buffer: jax.Array,
    cache: page_cache.CacheState, step: jax.Array, host, device, tp: TensorParallel | None,
) -> tuple[jax.Array, jax.Array, page_cache.CacheState, jax.Array]:
    """`sparse_decode_layer` with a GPU cache of chosen pages (`sparse.page_cache`): the step copies the chosen
    pages the cache lacks from the pinned `buffer` into it, then reads every chosen page from the cache with the
    kernel and order the store read would use: the same bits. -> (hidden, tail with the token's K, V, the cache after
    the step, int32 [hits, chosen, pages over PCIe] summed over the KV heads)."""
    q, tail, state = _decode_inputs(cfg, layer, x, inv_freq, tail, position, tail_len, tp)

    def local(q, meta, buffer, cache, state, num_pages, step):
        pages = _chosen_pages(impl, q, scorer, meta, num_pages, num_candidates, budget_pages)
        one_region = page_cache.CacheState(None, *(m[None] for m in cache[1:]))  # the whole cache, region 0
        kv, reads, maps, counts = _cache_fill(
            impl, pages, num_candidates, lambda p: quest.page_rows(p, num_candidates, page_size, block_size),
            cache.kv, one_region, jnp.zeros(1, jnp.int32), cache.page.shape[1], step[None], buffer, page_size, host,
            device, tp)
        state = attend_rows(impl, q, kv, reads, jnp.minimum(num_pages, budget_pages) * page_size, state, device,
                            device)
        return state, page_cache.CacheState(kv, *(m[0] for m in maps[1:])), counts[0]

    meta_heads = tuple(METADATA_HEADS for _ in meta)
    cache_heads = page_cache.CacheState(BUFFER_HEADS, 0, 0, 0)
    state, cache, counts = _local(tp, local, (HEADS, meta_heads, BUFFER_HEADS, cache_heads, STATE_HEADS, None, None),
                                  (STATE_HEADS, cache_heads, None))(q, tuple(meta), buffer, cache, state, num_pages,
                                                                    step)
    return _finish_decode(cfg, impl, layer, x, q, tail, tail_len, position, state, tp), tail, cache, counts


@functools.partial(step_jit, static_argnums=(0, 1, 8, 10, 11, 12, 13, 18, 19), static_argnames=("tp",),
                   donate_argnums=(5, 16))
def cached_sparse_decode_layers(
    cfg: ModelConfig, impl: str, layers: tuple[LayerParams, ...], x: jax.Array, inv_freq: jax.Array,
    tails: tuple[jax.Array, ...], position: jax.Array, tail_len: jax.Array, scorer, metas: tuple,
    budget_pages: int, page_size: int, block_size: int, num_candidates: int, num_pages: jax.Array,
    buffers: tuple[jax.Array, ...], caches: tuple[page_cache.CacheState, ...], step: jax.Array, host, device,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[page_cache.CacheState, ...], jax.Array]:
    """Consecutive sparse layers with their page caches as one program (each launch costs the host ~0.5 ms besides
    its kernels, more than such a layer's GPU time once its pages come from the cache): `_cached_sparse_decode_layer`
    for each, with its own tail, metadata, store layer and cache. -> (hidden, tails, caches, int32 [layers, 3]
    counts)."""
    tails, caches, counts = list(tails), list(caches), []
    for i, layer in enumerate(layers):
        x, tails[i], caches[i], layer_counts = _cached_sparse_decode_layer(
            cfg, impl, layer, x, inv_freq, tails[i], position, tail_len, scorer, metas[i], budget_pages, page_size,
            block_size, num_candidates, num_pages, buffers[i], caches[i], step, host, device, tp)
        counts.append(layer_counts)
    return x, tuple(tails), tuple(caches), jnp.stack(counts)


# Steps of `sparse_decode_layer` as calls of their own, for the benchmark to time apart: the choice (with the
# layer's q), and the read of the chosen pages with attention over them.
page_choice_step = functools.partial(step_jit, static_argnums=(0, 1, 8, 10, 11, 12, 13))(_page_choice)
page_read_step = functools.partial(step_jit, static_argnums=(0, 6, 7))(attend_rows)


@functools.partial(step_jit, static_argnums=(0, 1, 2), static_argnames=("xattn", "tp"))
def layerwise_layer(
    cfg: ModelConfig, impl: str, block_size: int, layer: LayerParams, x: jax.Array, inv_freq: jax.Array,
    prompt_len: jax.Array, xattn: XAttention | None = None, tp: TensorParallel | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], jax.Array]:
    """One layer over the whole prompt x [1, T, hidden] (T a multiple of block_size); its KV as blocks, and the
    [selected, visible] XAttention block counts."""
    layer = layer.for_prompt_tokens()
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    q, k, v = split_qkv(cfg, tp, layer, x, positions, inv_freq)
    o, counts = prompt_attention(impl, xattn, q, k, v, prompt_len, tp)
    kv = jnp.stack([k[0], v[0]])
    blocks = tuple(kv[:, i : i + block_size] for i in range(0, x.shape[1], block_size))
    return decoder.attention_output_and_mlp(cfg, layer, x, o), blocks, counts


# ---- XAttention over the offloaded KV: a prompt chunk estimates and attends over every earlier key at once. The
# earlier blocks stream once through the ring into the layer's key and value buffers (the chunk's own KV joins them);
# the estimate and the block-sparse attention then read the buffers' first `span` keys: no second stream of the
# chosen blocks, and no wait for the host to learn which those were.


@functools.partial(step_jit, donate_argnums=(0, 1))
def gather_kv(keys: jax.Array, values: jax.Array, blocks: tuple[jax.Array, ...], starts: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes host blocks into the layer's key and value buffers [1, max_len, Hkv, D], block i's first key at
    starts[i] (a padded group's repeats all go to the current chunk's place, which its own KV overwrites next); also
    returns a value computed from the blocks on every device (one key element per head), to tell when their slots are
    free. The buffers are donated: written in place (at 1M tokens, 2 GB each a layer and chunk)."""
    for i, block in enumerate(blocks):
        k, v = _join_blocks((block,), keys.dtype)
        keys = jax.lax.dynamic_update_slice(keys, k, (0, starts[i], 0, 0))
        values = jax.lax.dynamic_update_slice(values, v, (0, starts[i], 0, 0))
    return keys, values, k[0, 0, :, 0]


@functools.partial(step_jit, static_argnums=(0, 1, 2), static_argnames=("span", "tp"), donate_argnums=(7, 8))
def xattn_chunk_layer(
    cfg: ModelConfig, impl: str, xattn: XAttention, layer: LayerParams, x: jax.Array, q: jax.Array, kv: jax.Array,
    keys: jax.Array, values: jax.Array, start: jax.Array, chunk_len: jax.Array, span: int | None = None,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The rest of a layer for a prompt chunk (queries q [1, T, Hq, D] at `start`, its KV kv [2, T, Hkv, D]) under
    XAttention, over the earlier keys and values in the buffers and the chunk's own -> (the layer's output, the
    buffers with the chunk's KV, [selected, visible] blocks). The estimate and the attention read the buffers' first
    `span` keys (at least through the chunk), not all max_len: one choice and one attention call over keys
    0..start + chunk_len, as the whole prompt in GPU memory makes them for these rows."""
    keys = jax.lax.dynamic_update_slice(keys, kv[0][None].astype(keys.dtype), (0, start, 0, 0))
    values = jax.lax.dynamic_update_slice(values, kv[1][None].astype(values.dtype), (0, start, 0, 0))
    k, v, end = keys[:, :span], values[:, :span], start + chunk_len
    mask = xattn_select(impl, xattn, q, k, q_offset=start, kv_len=end, tp=tp)
    o, _ = xattn_attention(impl, xattn, q, k, v, mask, causal=True, q_offset=start, kv_len=end, out_dtype=q.dtype,
                           tp=tp)
    counts = xattention.block_counts(mask, start, end, xattn.block)
    return decoder.attention_output_and_mlp(cfg, layer.for_prompt_tokens(), x, o), keys, values, counts
