"""Folds the float32 results of consecutive key splits into an attention state, one split after another.

Decode kernels cut the keys into fixed splits attended in parallel; `fold_splits` then merges the splits' (o, lse)
into the running `AttentionState` strictly in split order, with the formula of `merge_into_state`, in one
program per (sequence, KV head) and block of its columns. The order of operations depends on nothing but the keys'
positions: not on the batch, nor on how many splits a kernel call covered, nor on whether the keys arrived in one
call or block by block from the host. So decode gives the same bits alone or batched, in GPU memory or offloaded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (_TARGET_PROGRAMS, LOG2E, NEG_INF, compiler_params, interpret_aware_jit, next_pow2,
                                    resolve_interpret)
from pallas_kernels.state import AttentionState, by_kv_heads, from_kv_heads


# Most splits loaded together per loop step: their loads are issued at once, a step ahead of their fold, so that
# their latency hides behind the previous step's folds (the fold is latency-bound: each program walks every split).
# A call of fewer splits loads fewer a step (`_splits_per_step`): 32 tiles held in registers cost occupancy where
# many short sequences (one or two splits each) fill the grid (a fold of 256 sequences of one split on an H200:
# 27.0 us at 16 a step, 16.3 at one). The step only groups loads: every split is folded by the same
# operations in the same order, so the bits do not depend on it (1 to 16 a step on the H200: 40 of 40 the same,
# bench/results/runs/h200_invariant_price/price_2026_12_01/fold_steps/).
_MAX_SPLITS_PER_STEP = 16


def _splits_per_step(num_splits: int) -> int:
    return min(_MAX_SPLITS_PER_STEP, next_pow2(num_splits))


def _column_blocks(programs: int, d: int) -> int:
    """Column blocks a (sequence, KV head): up to ~_TARGET_PROGRAMS programs in all, blocks of >= 16 columns. A fold
    is latency-bound in each program (its splits one after another), so where few (sequence, KV head)s fold, more
    programs each loading a part of the columns take less time: batch-1 decode at 128K, 8 KV heads of 128 splits,
    was 13.9 us a fold with one program each (0.44 ms of a 9.6 ms step on an H200); with 8 blocks each (64 programs)
    the mode's step was 0.04 ms shorter
    (bench/results/runs/h200_invariant_price/price_2026_12_01/batch1_128k_column_blocks/)."""
    blocks = 1
    while blocks * 2 * programs <= _TARGET_PROGRAMS and d // (blocks * 2) >= 16:
        blocks *= 2
    return blocks


def _fold_one_split(carry, o, lse, live):
    """A running state (acc [rows, D], m and l [rows, 1], m in log2 units) with one split's float32 (o [rows, D],
    natural-log lse [rows, 1]) folded in where `live`, as it was elsewhere: the operations every decode fold runs."""
    acc, m, l = carry
    lse2 = lse * LOG2E
    m_new = jnp.maximum(m, lse2)
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)  # both empty: keep exp2() finite
    w_old, w_new = jnp.exp2(m - m_use), jnp.exp2(lse2 - m_use)
    part = jnp.where(w_new > 0, w_new * o, 0.0)  # an empty split's o may be anything
    new = (acc * w_old + part, m_new, l * w_old + w_new)
    return tuple(jnp.where(live, x, y) for x, y in zip(new, carry))  # past the live splits: unchanged


def _fold_kernel(live_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref, acc_out, m_out, l_out, *, group: int,
                 per_step: int):
    # Row statistics are [rows, 1] columns, as acc's rows: a statistic meets acc with no layout change between them
    # (~10% of the fold on an H200, the same bits: bench/results/runs/h200_fold/).
    rows = acc_ref.shape[0]
    row_ok = (jnp.arange(rows) < group)[:, None]
    acc = plgpu.load(acc_ref, mask=row_ok, other=0.0)
    m = plgpu.load(m_ref, mask=row_ok, other=NEG_INF)
    l = plgpu.load(l_ref, mask=row_ok, other=0.0)
    num_live = live_ref[()]
    num_splits = o_ref.shape[0]

    def load_step(i):
        """The splits of loop step i (clamped to the last split past the end: loaded, never folded)."""
        loaded = []
        for u in range(per_step):
            s = jnp.minimum(i * per_step + u, num_splits - 1)
            loaded.append((plgpu.load(o_ref.at[s], mask=row_ok, other=0.0),
                           plgpu.load(lse_ref.at[s], mask=row_ok, other=NEG_INF)))
        return loaded

    def step(i, carry_and_loaded):
        carry, loaded = carry_and_loaded
        upcoming = load_step(i + 1)  # issued before this step's folds, which do not need it
        for u, (o, lse) in enumerate(loaded):
            carry = _fold_one_split(carry, o, lse, i * per_step + u < num_live)
        return carry, upcoming

    steps = (num_live + per_step - 1) // per_step
    (acc, m, l), _ = lax.fori_loop(0, steps, step, ((acc, m, l), load_step(0)))
    plgpu.store(acc_out, acc, mask=row_ok)
    plgpu.store(m_out, m, mask=row_ok)
    plgpu.store(l_out, l, mask=row_ok)


def _fold(num_live, o_part, lse_part, acc, m, l, *, per_step, column_blocks, interpret):
    """num_live [B]; o_part [S, B, Hkv, G, D], lse_part [S, B, Hkv, G, 1]; acc [B, Hkv, G, D], m and l
    [B, Hkv, G, 1]. Each (sequence, KV head) is folded by `column_blocks` programs, each over its D / column_blocks
    columns of o and acc (m and l computed alike by all, from the same lse, and written by each: so no output may
    alias an input here, or a program could read what another has already written)."""
    num_splits, batch, hkv, group, d = o_part.shape
    rows = next_pow2(group)
    cols = d // column_blocks
    row_spec = pl.BlockSpec((None, None, rows, cols), lambda bh, c: (bh // hkv, bh % hkv, 0, c))
    stat_spec = pl.BlockSpec((None, None, rows, 1), lambda bh, c: (bh // hkv, bh % hkv, 0, 0))
    return pl.pallas_call(
        functools.partial(_fold_kernel, group=group, per_step=per_step),
        grid=(batch * hkv, column_blocks),
        in_specs=[pl.BlockSpec((None,), lambda bh, c: (bh // hkv,)),
                  pl.BlockSpec((num_splits, None, None, rows, cols), lambda bh, c: (0, bh // hkv, bh % hkv, 0, c)),
                  pl.BlockSpec((num_splits, None, None, rows, 1), lambda bh, c: (0, bh // hkv, bh % hkv, 0, 0)),
                  row_spec, stat_spec, stat_spec],
        out_specs=[row_spec, stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct(acc.shape, jnp.float32), jax.ShapeDtypeStruct(m.shape, jnp.float32),
                   jax.ShapeDtypeStruct(l.shape, jnp.float32)],
        compiler_params=compiler_params(4, 3),
        interpret=interpret,
        name="fold_splits",
    )(num_live, o_part, lse_part, acc, m, l)


_fold = interpret_aware_jit(_fold, ("per_step", "column_blocks", "interpret"))


def fold_splits(state: AttentionState, o_part: jax.Array, lse_part: jax.Array, num_live: jax.Array | None = None,
                interpret: bool | None = None, column_blocks: int | None = None) -> AttentionState:
    """Folds split results o_part [S, B, Hkv, G, D] (float32) and natural-log lse_part [S, B, Hkv, G], in
    ascending split order, into the decode state of B sequences (acc [B, 1, Hkv * G, D], m and l [B, Hkv * G, 1]).
    Sequence b folds its first num_live[b] splits (default all S; the others are never read). A split with
    lse = -inf (no key) leaves the state as it was.

    column_blocks (static): programs a (sequence, KV head), each folding D / column_blocks columns of the outputs
    (a power of two, at most D / 16); default: enough for ~128 programs on a GPU, one in the interpreter. Changes
    the speed, not the bits: every column is folded by its own operations."""
    num_splits, batch, hkv, group, d = o_part.shape
    if lse_part.shape != o_part.shape[:4]:
        raise ValueError(f"lse_part has shape {lse_part.shape} for o_part {o_part.shape}; allowed: "
                         f"{o_part.shape[:4]}")
    if column_blocks is None:
        column_blocks = 1 if resolve_interpret(interpret) else _column_blocks(batch * hkv, d)
    if column_blocks < 1 or column_blocks & (column_blocks - 1) or d % column_blocks or d // column_blocks < 16:
        raise ValueError(f"column_blocks={column_blocks}; allowed: a power of two with D / column_blocks >= 16 "
                         f"(D = {d})")
    num_live = jnp.full((batch,), num_splits, jnp.int32) if num_live is None else num_live.astype(jnp.int32)
    return from_kv_heads(*_fold(num_live, o_part.astype(jnp.float32), lse_part.astype(jnp.float32)[..., None],
                                *by_kv_heads(state, hkv), per_step=_splits_per_step(num_splits),
                                column_blocks=column_blocks, interpret=resolve_interpret(interpret)))
