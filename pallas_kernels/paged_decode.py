"""Paged decode attention (one new query token per sequence over a paged KV pool) with LSE.

The KV cache of a layer is a pool of fixed-size pages shared by all sequences (continuous
batching, as in vLLM / nano-vllm); a block table maps each sequence's logical pages to
physical ones. `paged_decode_attention_with_lse` launches one program per (page split,
batch x KV head); each program attends the whole query-head group of its KV head to the keys
of its pages, reading every page's physical index from the block table inside the key loop,
so the pages are never gathered in memory. The per-split states are merged in float32.
`paged_decode_attention_with_lse_xla` is the jnp twin (gathers the pages, then runs
`decode_attention_with_lse_xla`).

A float8_e4m3fn or int8 pool (the fp8 or int8 KV cache) comes with float32 scales, one per key or value vector,
in the pool's layout with a last axis of 1; the kernels dequantize each tile in registers (`_common.load_kv_rows`).

`paged_decode_attention_kv_with_lse` reads one pool that keeps a page's keys and values side by side,
[num_pages, 2, page_size, Hkv, D] (the offloaded store's page layout): sketch and Quest decode read the pages they
chose straight from the pinned host store with it, the kernel's loads crossing PCIe (zero copy).

Semantics: q [B, Hq, D]; k_pages/v_pages [num_pages, page_size, Hkv, D]; block_tables int32
[B, max_pages]; sequence b sees keys j < seq_lens[b], key j living at row j % page_size of
physical page block_tables[b, j // page_size]. Entries of block_tables at or past
ceil(seq_lens[b] / page_size) are padding and never read (any value, -1 included). o [B, Hq, D]
in q.dtype (or `out_dtype`), lse [B, Hq] float32 natural log; seq_lens[b] = 0 gives o = 0,
lse = -inf.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    _TARGET_PROGRAMS,
    check_pallas_head_dim,
    decode_key_tile,
    LOG2E,
    MIN_BLOCK,
    NEG_INF,
    cdiv,
    check_out_dtype,
    check_sm_scale,
    compiler_params,
    dot_precision,
    empty_softmax_state,
    fdiv,
    fit_block,
    finish_online_softmax,
    interpret_aware_jit,
    next_pow2,
    per_batch,
    resolve_interpret,
)
from pallas_kernels.decode import (
    decode_attention_with_lse_xla,
    default_decode_config,
    decode_splits,
)
from pallas_kernels.fold import _fold_one_split, fold_splits
from pallas_kernels.merge import merge_stack
from pallas_kernels.state import AttentionState, by_kv_heads, check_state, from_kv_heads


def _attend_paged_split(q, seq_len, start, bt_ref, k_ref, v_ref, k_scale_ref, v_scale_ref, *, scale_log2: float,
                page_size: int, page_stride: int, v_offset: int, block_k: int, split_len, precision):
    """Inside a program: the query group q [block_h, D] attended to the split of keys [start, start + split_len)
    (those below seq_len) of a paged pool whose block table row is bt_ref -> (o float32, natural-log lse)."""
    n_keys = jnp.clip(seq_len - start, 0, split_len)
    n_full = fdiv(n_keys, block_k)
    n_blocks = cdiv(n_keys, block_k)

    def body(j, carry, masked: bool):
        pos = start + j * block_k
        # Only pages below ceil(seq_len / page_size) are reached, so padding entries of the
        # block table are never read.
        phys = bt_ref[fdiv(pos, page_size)]
        row = pl.multiple_of(phys * page_stride + lax.rem(pos, jnp.int32(page_size)), block_k)
        vslice = pl.ds(pl.multiple_of(row + v_offset, block_k), block_k)
        # Rows of the tail page past seq_len may hold stale keys (even NaN): never loaded.
        col_ok = (j * block_k + jnp.arange(block_k, dtype=jnp.int32)) < n_keys if masked else None
        return decode_key_tile(carry, q, k_ref, v_ref, pl.ds(row, block_k), vslice, col_ok,
                               scale_log2=scale_log2, precision=precision, k_scale_ref=k_scale_ref,
                               v_scale_ref=v_scale_ref)

    carry = empty_softmax_state(q.shape[0], q.shape[-1])
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)
    return finish_online_softmax(*carry)


def _paged_decode_kernel(seqlen_ref, splitlen_ref, bt_ref, q_ref, k_ref, v_ref, *refs,
                         scale_log2: float, page_size: int, page_stride: int, v_offset: int,
                         block_k: int, num_programs: int, group: int, fold: bool, precision):
    # refs: (o, lse) of every split, or with `fold` (one program a (sequence, KV head)) the state in, then out
    # (acc, m, l each); an 8-bit pool's (k scales, v scales) come first.
    n_scales = len(refs) - (6 if fold else 2)
    k_scale_ref, v_scale_ref = refs[:n_scales] or (None, None)
    seq_len = seqlen_ref[()]
    split_len = splitlen_ref[()]
    num_splits = cdiv(seq_len, split_len)
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    # Rows past the group are zero queries; they are computed (tensor-core tiles are >= 16
    # rows) and never stored.
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)

    def attend(split):
        return _attend_paged_split(q, seq_len, split * split_len, bt_ref, k_ref, v_ref, k_scale_ref, v_scale_ref,
                                   scale_log2=scale_log2, page_size=page_size, page_stride=page_stride,
                                   v_offset=v_offset, block_k=block_k, split_len=split_len, precision=precision)

    if fold:
        # Each split folded into the state as soon as it is attended, by `fold_splits`' operations in its order: the
        # split states' float32 round trip and the fold kernel's launch go (256 sequences of 600 keys, 8B heads, on an
        # H200: 111 -> 102 us a layer, the same bits, runs/h200_invariant_price/price_2026_12_01/paged_fold_inline/).
        acc_in, m_in, l_in, acc_out, m_out, l_out = refs[n_scales:]
        state = (plgpu.load(acc_in, mask=row_ok[:, None], other=0.0),
                 plgpu.load(m_in, mask=row_ok[:, None], other=NEG_INF),
                 plgpu.load(l_in, mask=row_ok[:, None], other=0.0))

        def fold_split(split, state):
            o, lse = attend(split)
            return _fold_one_split(state, o, lse[:, None], True)

        for ref, x in zip((acc_out, m_out, l_out), lax.fori_loop(0, num_splits, fold_split, state)):
            plgpu.store(ref, x, mask=row_ok[:, None])
        return

    o_ref, lse_ref = refs[n_scales:]
    program = pl.program_id(0)

    def one_split(i, _):
        # Program p takes splits p, p + num_programs, ... that hold keys. Each starts from an empty state, so its
        # result does not depend on how splits map to programs.
        split = program + i * num_programs
        o, lse = attend(split)
        plgpu.store(o_ref.at[split], o, mask=row_ok[:, None])
        plgpu.store(lse_ref.at[split], lse, mask=row_ok)
        return _

    lax.fori_loop(0, cdiv(jnp.maximum(num_splits - program, 0), num_programs), one_split, 0)


def _paged_decode_parts(q, k_rows, v_rows, scale_rows, block_tables, seq_lens, split_lens, *, page_size, v_offset,
                        sm_scale, interpret, block_k, num_splits, num_programs, num_warps, num_stages, state=None):
    """Unmerged float32 states of consecutive key splits, sequence b's of split_lens[b] keys (a multiple of block_k),
    computed by `num_programs` programs per (sequence, KV head): o [S, B, Hkv, group, D], natural-log lse [S, B,
    Hkv, group] with S = num_splits (enough for the block table). Only the splits holding keys (the first
    ceil(seq_len / split_len)) are written; the others hold whatever the buffer held. With `state` (acc, m, l as [B,
    Hkv, group, D or 1], and num_programs 1): that state with the splits folded in, in order, by `fold_splits`'
    operations. k_rows, v_rows [rows, Hkv, D]: page p's keys are rows p * page_stride + [0, page_size) of k_rows,
    its values the same rows + v_offset of v_rows (page_stride = page_size for separate pools; a combined pool is
    passed as both, with page_stride = 2 * page_size and v_offset = page_size). scale_rows: None, or the float32
    scales (k, v) [rows, Hkv] of 8-bit rows, indexed as the rows are."""
    batch, hq, d = q.shape
    _, hkv, _ = k_rows.shape
    max_pages = block_tables.shape[1]
    group = hq // hkv
    block_h = max(MIN_BLOCK, next_pow2(group))
    kernel = functools.partial(
        _paged_decode_kernel, scale_log2=sm_scale * LOG2E, page_size=page_size,
        page_stride=page_size + v_offset, v_offset=v_offset, block_k=block_k, num_programs=num_programs, group=group,
        fold=state is not None, precision=dot_precision(q.dtype))
    qg = q.reshape(batch, hkv, group, d)
    # A key block is one contiguous row slice of a page, as in the contiguous kernel.
    kv_spec = pl.BlockSpec((k_rows.shape[0], None, d), lambda s, bh: (0, bh % hkv, 0))
    scales = () if scale_rows is None else tuple(scale_rows)
    scale_spec = pl.BlockSpec((k_rows.shape[0], None), lambda s, bh: (0, bh % hkv))
    # The query block is padded past the group to a full tensor-core tile.
    row_spec = pl.BlockSpec((None, None, block_h, d), lambda s, bh: (bh // hkv, bh % hkv, 0, 0))
    if state is None:
        state_specs = []
        out_specs = [
            pl.BlockSpec((num_splits, None, None, block_h, d), lambda s, bh: (0, bh // hkv, bh % hkv, 0, 0)),
            pl.BlockSpec((num_splits, None, None, block_h), lambda s, bh: (0, bh // hkv, bh % hkv, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, batch, hkv, group, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, hkv, group), jnp.float32),
        ]
    else:
        stat_spec = pl.BlockSpec((None, None, block_h, 1), lambda s, bh: (bh // hkv, bh % hkv, 0, 0))
        state_specs = out_specs = [row_spec, stat_spec, stat_spec]
        out_shape = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in state]
    return pl.pallas_call(
        kernel,
        grid=(num_programs, batch * hkv),
        in_specs=[
            pl.BlockSpec((None,), lambda s, bh: (bh // hkv,)),
            pl.BlockSpec((None,), lambda s, bh: (bh // hkv,)),
            pl.BlockSpec((None, max_pages), lambda s, bh: (bh // hkv, 0)),
            row_spec,
            kv_spec,
            kv_spec,
            *[scale_spec] * len(scales),
            *state_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_decode_attention_with_lse" if state is None else "paged_decode_state_folded",
    )(seq_lens, split_lens, block_tables, qg, k_rows, v_rows, *scales, *(state or ()))


def _paged_decode_pallas(q, k_rows, v_rows, scale_rows, block_tables, seq_lens, *, page_size, v_offset, sm_scale,
                         out_dtype, interpret, block_k, num_splits, num_warps, num_stages):
    """The splits of `_paged_decode_parts`, as many as asked (whole pages each), merged in one N-way merge."""
    batch, hq, d = q.shape
    max_pages = block_tables.shape[1]
    split_pages = -(-max_pages // num_splits)
    programs = -(-max_pages // split_pages)
    o_part, lse_part = _paged_decode_parts(
        q, k_rows, v_rows, scale_rows, block_tables, seq_lens, jnp.full((batch,), split_pages * page_size, jnp.int32),
        page_size=page_size, v_offset=v_offset, sm_scale=sm_scale, interpret=interpret, block_k=block_k,
        num_splits=programs, num_programs=programs, num_warps=num_warps, num_stages=num_stages)
    # Splits past a sequence's keys were never written: empty them before the merge.
    live = jnp.arange(o_part.shape[0])[:, None] < cdiv(seq_lens, split_pages * page_size)[None, :]
    lse_part = jnp.where(live[:, :, None, None], lse_part, NEG_INF)
    o, lse = merge_stack(o_part, lse_part)
    return o.reshape(batch, hq, d).astype(out_dtype), lse.reshape(batch, hq)


_paged_decode_pallas = interpret_aware_jit(
    _paged_decode_pallas, ("page_size", "v_offset", "sm_scale", "out_dtype", "interpret", "block_k",
                           "num_splits", "num_warps", "num_stages"))


def _paged_decode_state(q, k_rows, v_rows, scale_rows, block_tables, seq_lens, split_lens, state, *, page_size,
                        v_offset, sm_scale, interpret, block_k, num_splits, num_programs, fold_in_kernel, num_warps,
                        num_stages):
    launch = dict(page_size=page_size, v_offset=v_offset, sm_scale=sm_scale, interpret=interpret, block_k=block_k,
                  num_splits=num_splits, num_programs=num_programs, num_warps=num_warps, num_stages=num_stages)
    args = (q, k_rows, v_rows, scale_rows, block_tables, seq_lens, split_lens)
    if fold_in_kernel:
        return from_kv_heads(*_paged_decode_parts(*args, **launch, state=by_kv_heads(state, k_rows.shape[1])))
    o_part, lse_part = _paged_decode_parts(*args, **launch)
    return fold_splits(state, o_part, lse_part, cdiv(seq_lens, split_lens), interpret=interpret)


_paged_decode_state = interpret_aware_jit(
    _paged_decode_state, ("page_size", "v_offset", "sm_scale", "interpret", "block_k", "num_splits", "num_programs",
                          "fold_in_kernel", "num_warps", "num_stages"))


def paged_decode_state(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                       seq_lens: jax.Array, state: AttentionState, *, sm_scale: float | None = None,
                       split_len: int | None = None, total_lens: jax.Array | None = None,
                       interpret: bool | None = None, num_programs: int | None = None,
                       k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                       fold_in_kernel: bool | None = None) -> AttentionState:
    """Continues the decode state of each sequence over its keys in a paged pool, batch-invariantly.

    The keys are cut into splits from position 0 (`decode_state`'s: their length set by the sequence's whole
    length), attended in parallel, and folded into
    `state` in ascending order (by `fold_splits`, or its operations inside the attention kernel: `fold_in_kernel`):
    the same operations as `decode_state` over the same keys, whatever the batch, the block tables or how many
    programs run. Bits equal `decode_state`'s when page_size
    is at least the decode tile (128 keys in bfloat16, 32 in float32).

    Args: as `paged_decode_attention_with_lse`, plus
      state: AttentionState with acc [B, 1, Hq, D], m and l [B, Hq, 1].
      split_len: keys per split (static), a multiple of 16; None: `decode_split_lens(total_lens)`.
      total_lens: int32 [B], each sequence's keys in all its pieces (the pool holds its last piece); None:
        seq_lens.
      num_programs: programs per (sequence, KV head), each taking every num_programs-th split; default gives
        ~128 programs on a GPU, one a (sequence, KV head) in the interpreter. Changes the speed, not the bits.
      fold_in_kernel: True: one program per (sequence, KV head) folds each split into the state as soon as it has
        attended it (no split states in memory, no fold kernel; num_programs must then be None or 1); False: the
        splits' states, then `fold_splits`; None: True where one program walks a sequence's splits (num_programs
        comes to 1) on a GPU. The same operations in the same order: on an H200 the same bits. The CPU
        interpreter's bits follow the surrounding program (an ulp apart in places), so there it defaults to False,
        the form every other path folds in.
    """
    block_tables, seq_lens = _check_paged_args(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales)
    num_pages, page_size, hkv, d = k_pages.shape
    rows = num_pages * page_size
    return _launch_state(q, k_pages.reshape(rows, hkv, d), v_pages.reshape(rows, hkv, d),
                         _scale_rows(rows, hkv, k_scales, v_scales), block_tables, seq_lens, state, page_size=page_size,
                         v_offset=0, sm_scale=sm_scale, split_len=split_len, total_lens=total_lens,
                         interpret=interpret, num_programs=num_programs, fold_in_kernel=fold_in_kernel)


def _launch_state(q, k_rows, v_rows, scale_rows, block_tables, seq_lens, state, *, page_size, v_offset, sm_scale,
                  split_len, total_lens, interpret, num_programs, fold_in_kernel):
    """Checks the state and split length, defaults the launch parameters (see `paged_decode_state`) and runs the
    kernel and the fold."""
    batch, hq, d = q.shape
    hkv = k_rows.shape[1]
    check_pallas_head_dim(d)
    check_state(state, batch, 1, hq, d)
    split_lens, min_split, max_splits = decode_splits(
        split_len, seq_lens if total_lens is None else per_batch(total_lens, batch, "total_lens"),
        block_tables.shape[1] * page_size, total_lens is None)
    cfg = default_decode_config(q.dtype)
    if fold_in_kernel and num_programs not in (None, 1):
        raise ValueError(f"num_programs={num_programs} with fold_in_kernel=True; allowed: None or 1 (one program "
                         "walks a sequence's splits and folds them)")
    interpret = resolve_interpret(interpret)
    if num_programs is None:
        # The interpreter runs programs one after another, each at a fixed cost: one a (sequence, KV head) there.
        num_programs = 1 if interpret else -(-_TARGET_PROGRAMS // (batch * hkv))
    num_programs = int(max(1, min(num_programs, max_splits)))
    if fold_in_kernel is None:
        fold_in_kernel = num_programs == 1 and not interpret
    return _paged_decode_state(
        q, k_rows, v_rows, scale_rows, block_tables, seq_lens, split_lens, state, page_size=page_size,
        v_offset=v_offset, sm_scale=check_sm_scale(sm_scale, d), interpret=interpret,
        block_k=math.gcd(cfg["block_k"], min_split, page_size), num_splits=max_splits,
        num_programs=1 if fold_in_kernel else num_programs, fold_in_kernel=bool(fold_in_kernel),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def paged_decode_state_kv(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                          state: AttentionState, *, kv_scales: jax.Array | None = None, sm_scale: float | None = None,
                          split_len: int | None = None, total_lens: jax.Array | None = None,
                          interpret: bool | None = None, num_programs: int | None = None,
                          fold_in_kernel: bool | None = None) -> AttentionState:
    """`paged_decode_state` over one pool kv_pages [num_pages, 2, page_size, Hkv, D] whose page p holds its keys at
    [p, 0] and its values at [p, 1] (an 8-bit pool's scales as kv_scales [num_pages, 2, page_size, Hkv, 1]); same
    arguments and bits rule: each sequence's result depends on its own keys and split lengths only, not on the batch,
    the width of the block tables or `num_programs`. The pool may live in pinned host memory, as for
    `paged_decode_attention_kv_with_lse`."""
    block_tables, seq_lens, pool, scale_rows = _kv_pool_args(q, kv_pages, kv_scales, block_tables, seq_lens)
    page_size = kv_pages.shape[2]
    return _launch_state(q, pool, pool, scale_rows, block_tables, seq_lens, state, page_size=page_size,
                         v_offset=page_size, sm_scale=sm_scale, split_len=split_len, total_lens=total_lens,
                         interpret=interpret,
                         num_programs=num_programs, fold_in_kernel=fold_in_kernel)


def _scale_rows(rows: int, hkv: int, k_scales, v_scales):
    """None, or the scales of k and v as [rows, Hkv] (the kernel's row indexing)."""
    if k_scales is None:
        return None
    return k_scales.reshape(rows, hkv), v_scales.reshape(rows, hkv)


def _check_paged_args(q, k_pages, v_pages, block_tables, seq_lens, k_scales=None, v_scales=None):
    """Validate the arguments; returns (int32 block_tables, int32 seq_lens clamped to the table)."""
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}; allowed: rank 3 [B, Hq, D]")
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages has shape {k_pages.shape} and v_pages {v_pages.shape}; "
                         "allowed: equal shapes [num_pages, page_size, Hkv, D]")
    batch, hq, d = q.shape
    num_pages, page_size, hkv, kd = k_pages.shape
    if kd != d:
        raise ValueError(f"q has shape {q.shape} and k_pages {k_pages.shape}; allowed: the same "
                         "head_dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}; allowed: Hq % Hkv == 0")
    if num_pages == 0:
        raise ValueError("k_pages has 0 pages; allowed: num_pages >= 1")
    if page_size < MIN_BLOCK or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}; allowed: a power of two >= {MIN_BLOCK}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales: give both (an 8-bit pool) or neither")
    if k_scales is not None:
        _check_scales(k_pages, k_scales, v_pages, v_scales)
    elif q.dtype != k_pages.dtype or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"q, k_pages, v_pages have dtypes {q.dtype}, {k_pages.dtype}, "
                         f"{v_pages.dtype}; allowed: one dtype")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q has dtype {q.dtype}; allowed: a floating dtype")
    block_tables = jnp.asarray(block_tables)
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables has shape {block_tables.shape}; allowed: "
                         f"({batch}, max_pages) with max_pages >= 1")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables has dtype {block_tables.dtype}; allowed: an integer type")
    capacity = block_tables.shape[1] * page_size
    seq_lens = jnp.clip(per_batch(seq_lens, batch, "seq_lens"), 0, capacity)
    return block_tables.astype(jnp.int32), seq_lens


def paged_decode_attention_with_lse(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                    block_tables: jax.Array, seq_lens: jax.Array, *,
                                    sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
                                    interpret: bool | None = None, block_k: int | None = None,
                                    num_splits: int | None = None, num_warps: int | None = None,
                                    num_stages: int | None = None, k_scales: jax.Array | None = None,
                                    v_scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of one query token per sequence over a paged KV pool, with LSE.

    Args:
      q: [B, Hq, D]; k_pages, v_pages: [num_pages, page_size, Hkv, D] (one layer's pool,
        page_size a power of two >= 16) with Hq % Hkv == 0; D a power of two in [16, 256].
      block_tables: int [B, max_pages]; logical page p of sequence b is physical page
        block_tables[b, p]. Entries at or past ceil(seq_lens[b] / page_size) are never read;
        the others must lie in [0, num_pages). May be traced (no recompile).
      seq_lens: int [B] (or a scalar); keys j < seq_lens[b] are visible. Clamped to
        [0, max_pages * page_size]. May be traced (no recompile).
      sm_scale: score scale, default 1/sqrt(D). Static.
      out_dtype: dtype of o, default q.dtype. Static; float32 keeps the merged split states
        unrounded.
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      block_k: keys per tile load, a power of two >= 16, shrunk to page_size; default the
        contiguous decode kernel's tile (128 bf16, 32 float32) capped at page_size, so a bf16
        page of <= 128 keys is one tile load and a 256-key page two (the K and V tiles of every
        pipeline stage must fit in shared memory).
      num_splits: page splits (static); default gives ~128 programs on a GPU and 4 splits in
        interpret mode; capped at max_pages. num_warps, num_stages: Triton launch params.
      k_scales, v_scales: None, or (a float8_e4m3fn or int8 pool) float32 [num_pages, page_size, Hkv, 1], one scale per
        key and value vector: the kernel computes values * scale in float32 and rounds it to q's dtype in
        registers before the dot products.

    Returns:
      o [B, Hq, D] in out_dtype (default q.dtype) and lse [B, Hq] float32 (natural log).
    """
    block_tables, seq_lens = _check_paged_args(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales)
    num_pages, page_size, hkv, d = k_pages.shape
    rows = num_pages * page_size  # page p starts at row p * page_size (a free reshape)
    return _launch(q, k_pages.reshape(rows, hkv, d), v_pages.reshape(rows, hkv, d),
                   _scale_rows(rows, hkv, k_scales, v_scales), block_tables, seq_lens,
                   page_size=page_size, v_offset=0, sm_scale=sm_scale, out_dtype=out_dtype, interpret=interpret,
                   block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def paged_decode_attention_kv_with_lse(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                                       seq_lens: jax.Array, kv_scales: jax.Array | None = None,
                                       **options) -> tuple[jax.Array, jax.Array]:
    """`paged_decode_attention_with_lse` over one pool kv_pages [num_pages, 2, page_size, Hkv, D]
    whose page p holds its keys at [p, 0] and its values at [p, 1]; same arguments and results
    (an 8-bit pool's scales as kv_scales [num_pages, 2, page_size, Hkv, 1]).

    The pool may live in pinned host memory (memory kind "pinned_host") when the call runs on a
    GPU inside `jax.jit`: the kernel then reads only the pages its block tables name, over PCIe,
    and nothing copies the pool."""
    block_tables, seq_lens, pool, scale_rows = _kv_pool_args(q, kv_pages, kv_scales, block_tables, seq_lens)
    page_size = kv_pages.shape[2]
    return _launch(q, pool, pool, scale_rows, block_tables, seq_lens, page_size=page_size, v_offset=page_size,
                   **options)


def _check_kv_pool(kv_pages) -> None:
    if kv_pages.ndim != 5 or kv_pages.shape[1] != 2:
        raise ValueError(f"kv_pages has shape {kv_pages.shape}; allowed: [num_pages, 2, page_size, Hkv, D]")


def _kv_pool_args(q, kv_pages, kv_scales, block_tables, seq_lens):
    """Checks the arguments of a call over one pool kv_pages [num_pages, 2, page_size, Hkv, D] (scales
    [num_pages, 2, page_size, Hkv, 1]) -> (block tables, key counts, the pool as kernel rows [rows, Hkv, D] with a
    page's keys then its values, the scales' rows or None)."""
    _check_kv_pool(kv_pages)
    num_pages, _, page_size, hkv, d = kv_pages.shape
    half = jax.ShapeDtypeStruct((num_pages, page_size, hkv, d), kv_pages.dtype)
    half_scales = None if kv_scales is None else jax.ShapeDtypeStruct((num_pages, page_size, hkv, 1), kv_scales.dtype)
    if kv_scales is not None and kv_scales.shape != (num_pages, 2, page_size, hkv, 1):
        raise ValueError(f"kv_scales has shape {kv_scales.shape}; allowed: {(num_pages, 2, page_size, hkv, 1)}")
    block_tables, seq_lens = _check_paged_args(q, half, half, block_tables, seq_lens, half_scales, half_scales)
    rows = num_pages * 2 * page_size
    return block_tables, seq_lens, kv_pages.reshape(rows, hkv, d), _scale_rows(rows, hkv, kv_scales, kv_scales)


def _check_scales(k_pages, k_scales, v_pages, v_scales) -> None:
    for name, pages, scales in (("k", k_pages, k_scales), ("v", v_pages, v_scales)):
        if pages.dtype not in (jnp.float8_e4m3fn, jnp.int8):
            raise ValueError(f"{name}_pages has dtype {pages.dtype} with scales; allowed: float8_e4m3fn, int8")
        if scales.shape != (*pages.shape[:-1], 1) or scales.dtype != jnp.float32:
            raise ValueError(f"{name}_scales has shape {scales.shape} and dtype {scales.dtype}; allowed: float32 "
                             f"{(*pages.shape[:-1], 1)}")


def _launch(q, k_rows, v_rows, scale_rows, block_tables, seq_lens, *, page_size, v_offset, sm_scale=None,
            out_dtype=None, interpret=None, block_k=None, num_splits=None, num_warps=None, num_stages=None):
    """Defaults the launch parameters (see `paged_decode_attention_with_lse`) and runs the kernel."""
    batch, _, d = q.shape
    hkv = k_rows.shape[1]
    max_pages = block_tables.shape[1]
    check_pallas_head_dim(d)
    cfg = default_decode_config(q.dtype)
    # A power of two <= page_size (larger requests shrink to the page), so it divides the page.
    block_k = fit_block(block_k or cfg["block_k"], page_size)
    interpret = resolve_interpret(interpret)
    if num_splits is None:
        # Interpret mode runs programs one after another, so extra splits only cost time.
        num_splits = 4 if interpret else -(-_TARGET_PROGRAMS // (batch * hkv))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}; allowed: >= 1")
    return _paged_decode_pallas(
        q, k_rows, v_rows, scale_rows, block_tables, seq_lens, page_size=page_size, v_offset=v_offset,
        sm_scale=check_sm_scale(sm_scale, d),
        out_dtype=check_out_dtype(out_dtype, q.dtype), interpret=interpret, block_k=block_k,
        num_splits=int(min(num_splits, max_pages)), num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"])


@jax.jit
def _gather_pages(k_pages, v_pages, block_tables, seq_lens):
    """[B, max_pages * page_size, Hkv, D] keys and values of every sequence, in logical order.

    Padding entries of the block table (any value, -1 or out of range included) are replaced by
    page 0, so the gather only takes in-range indices; values past seq_len are zeroed, so stale
    (even NaN) rows of a tail page or of page 0 never reach the result.
    """
    batch, max_pages = block_tables.shape
    _, page_size, hkv, d = k_pages.shape
    live = jnp.arange(max_pages, dtype=jnp.int32)[None, :] < cdiv(seq_lens, page_size)[:, None]
    table = jnp.where(live, block_tables, 0)
    k = k_pages[table].reshape(batch, max_pages * page_size, hkv, d)
    v = v_pages[table].reshape(batch, max_pages * page_size, hkv, d)
    # Masked scores give exactly zero weight, but 0 * NaN would not be zero.
    visible = jnp.arange(max_pages * page_size, dtype=jnp.int32)[None, :] < seq_lens[:, None]
    return k, jnp.where(visible[:, :, None, None], v, jnp.zeros((), v.dtype))


def paged_decode_attention_with_lse_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                        block_tables: jax.Array, seq_lens: jax.Array, *,
                                        sm_scale: float | None = None, out_dtype: jnp.dtype | None = None,
                                        interpret: bool | None = None, k_scales: jax.Array | None = None,
                                        v_scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """jnp twin of `paged_decode_attention_with_lse` (exact float32; `interpret` ignored).

    For each sequence in turn (`lax.map`), gathers its pages into a contiguous [1, max_pages * page_size, Hkv, D]
    cache (dequantized as the kernel does, for an 8-bit pool) and runs `decode_attention_with_lse_xla` with
    kv_len = its seq_len. One sequence at a time, every sequence's arithmetic has the same shapes whatever the
    batch: XLA's CPU dots choose their algorithm by shape, and a batched one changed a sequence's bits with the
    batch size (tiny Qwen3 in bfloat16, batch 8 against 4). A padding row (seq_len 0) is skipped: o = 0 and
    lse = NEG_INF, as attention over no key gives.
    """
    del interpret
    block_tables, seq_lens = _check_paged_args(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales)
    out_dtype = check_out_dtype(out_dtype, q.dtype)

    def attend(q_row, table, length):
        k, v = _gather_pages(k_pages, v_pages, table, length)
        if k_scales is not None:
            ks, vs = _gather_pages(k_scales, v_scales, table, length)
            k, v = ((x.astype(jnp.float32) * sc).astype(q.dtype) for x, sc in ((k, ks), (v, vs)))
        o, lse = decode_attention_with_lse_xla(q_row, k, v, kv_len=length, sm_scale=sm_scale, out_dtype=out_dtype)
        return o[0], lse[0]

    def nothing(q_row, table, length):
        return jnp.zeros(q_row.shape[1:], out_dtype), jnp.full(q_row.shape[1:2], NEG_INF, jnp.float32)

    def one(row):
        q_row, table, length = (x[None] for x in row)
        return lax.cond(length[0] > 0, attend, nothing, q_row, table, length)

    return lax.map(one, (q, block_tables, seq_lens))


def paged_decode_attention_kv_with_lse_xla(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                                           seq_lens: jax.Array, kv_scales: jax.Array | None = None,
                                           **options) -> tuple[jax.Array, jax.Array]:
    """jnp twin of `paged_decode_attention_kv_with_lse` (the pool in device memory)."""
    _check_kv_pool(kv_pages)
    scales = {} if kv_scales is None else dict(k_scales=kv_scales[:, 0], v_scales=kv_scales[:, 1])
    return paged_decode_attention_with_lse_xla(q, kv_pages[:, 0], kv_pages[:, 1], block_tables, seq_lens,
                                               **scales, **options)
