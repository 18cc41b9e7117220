"""Probe: does a fold that groups the splits shorten batch-1 decode's fold at long contexts (issue 64's 128K point)?

`fold_splits` walks a (sequence, KV head)'s splits one after another in one program (the column blocks only split
D's columns among programs; each still walks every split): at 128K, 128 splits of 1,024 keys, ~13 us a layer on an
H200, ~0.4 ms of the mode's +0.56 ms a token. Another order, still fixed by key positions alone: groups of T
consecutive splits, each folded from the empty state in split order, then the groups merged into the state in
order. Two forms of that one order:
- `two stages`: one program per (group, KV head) folds its T splits (stage 1: S / T x Hkv programs), then one per
  (KV head, column block) merges the groups in order (stage 2: a chain of S / T);
- `one program`: the same operations, each program computing its groups one after another (the form a kernel
  that attends and folds in one pass, as the workload's paged decode does, would take).
Their bits must be equal (on a GPU; the CPU interpreter's follow the surrounding program); with T = 1 both must
equal the library's (a split folded into the empty state is (o, lse * log2 e, 1), which the merge then folds as
`_fold_one_split` does). Each figure: a jitted chain of 64 dependent folds, median of 7 runs (min-max), per fold,
batch 1, 8 KV heads of 4 query rows, D 128, at 32 and 128 splits (8K and 128K). On a CPU it only checks the bits.

    python bench/probes/probe_fold_groups.py --out $OUT/fold_groups.json
"""
import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from common import run_metadata  # noqa: E402
import pallas_kernels  # noqa: E402
from pallas_kernels._common import NEG_INF, compiler_params  # noqa: E402
from pallas_kernels.fold import _column_blocks, _fold_one_split  # noqa: E402
from pallas_kernels.state import AttentionState, by_kv_heads, from_kv_heads  # noqa: E402

CHAIN, RUNS = 64, 7
INTERPRET = jax.default_backend() != "gpu"


def _merge(a, b):
    """Partial states (acc [rows, cols], m in log2 units and l [rows, 1]) of adjacent key ranges, a's first; an
    empty one (m = -inf) leaves the other's bits."""
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
    m = jnp.maximum(m_a, m_b)
    m_use = jnp.where(m == NEG_INF, 0.0, m)
    w_a, w_b = jnp.exp2(m_a - m_use), jnp.exp2(m_b - m_use)
    merged = (acc_a * w_a + acc_b * w_b, m, l_a * w_a + l_b * w_b)
    a_empty, b_empty = m_a == NEG_INF, m_b == NEG_INF
    return tuple(jnp.where(b_empty, xa, jnp.where(a_empty, xb, x)) for x, xa, xb in zip(merged, a, b))


def _group_state(o_ref, lse_ref, first, t):
    """Splits first .. first + t - 1 folded from the empty state in order."""
    rows, cols = o_ref.shape[-2:]
    carry = (jnp.zeros((rows, cols), jnp.float32), jnp.full((rows, 1), NEG_INF, jnp.float32),
             jnp.zeros((rows, 1), jnp.float32))
    for u in range(t):
        carry = _fold_one_split(carry, o_ref[first + u], lse_ref[first + u], True)
    return carry


def _specs(hkv, group, cols, lead=None):
    lead_dim = () if lead is None else (lead,)
    lead_idx = () if lead is None else (0,)
    row = pl.BlockSpec((*lead_dim, None, None, group, cols), lambda bh, c: (*lead_idx, bh // hkv, bh % hkv, 0, c))
    stat = pl.BlockSpec((*lead_dim, None, None, group, 1), lambda bh, c: (*lead_idx, bh // hkv, bh % hkv, 0, 0))
    return row, stat


def two_stages(o_part, lse_part, state, *, t):
    num_splits, batch, hkv, group, d = o_part.shape
    groups = num_splits // t
    acc, m, l = by_kv_heads(state, hkv)

    def stage1(o_ref, lse_ref, acc_out, m_out, l_out):
        acc_out[...], m_out[...], l_out[...] = _group_state(o_ref, lse_ref, 0, t)

    grp_row = pl.BlockSpec((None, None, None, group, d), lambda g, bh: (g, bh // hkv, bh % hkv, 0, 0))
    grp_stat = pl.BlockSpec((None, None, None, group, 1), lambda g, bh: (g, bh // hkv, bh % hkv, 0, 0))
    acc_g, m_g, l_g = pl.pallas_call(
        stage1, grid=(groups, batch * hkv),
        in_specs=[pl.BlockSpec((t, None, None, group, d), lambda g, bh: (g, bh // hkv, bh % hkv, 0, 0)),
                  pl.BlockSpec((t, None, None, group, 1), lambda g, bh: (g, bh // hkv, bh % hkv, 0, 0))],
        out_specs=[grp_row, grp_stat, grp_stat],
        out_shape=[jax.ShapeDtypeStruct((groups, batch, hkv, group, d), jnp.float32),
                   jax.ShapeDtypeStruct((groups, batch, hkv, group, 1), jnp.float32),
                   jax.ShapeDtypeStruct((groups, batch, hkv, group, 1), jnp.float32)],
        compiler_params=compiler_params(4, 3), interpret=INTERPRET, name="fold_groups_stage1",
    )(o_part, lse_part[..., None])

    blocks = 1 if INTERPRET else _column_blocks(batch * hkv, d)
    cols = d // blocks

    def stage2(accg_ref, mg_ref, lg_ref, acc_ref, m_ref, l_ref, acc_out, m_out, l_out):
        def body(j, carry):
            return _merge(carry, (accg_ref[j], mg_ref[j], lg_ref[j]))

        acc_out[...], m_out[...], l_out[...] = lax.fori_loop(0, groups, body, (acc_ref[...], m_ref[...], l_ref[...]))

    row, stat = _specs(hkv, group, cols)
    lead_row, lead_stat = _specs(hkv, group, cols, lead=groups)
    acc, m, l = pl.pallas_call(
        stage2, grid=(batch * hkv, blocks),
        in_specs=[lead_row, lead_stat, lead_stat, row, stat, stat],
        out_specs=[row, stat, stat],
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (acc, m, l)],
        compiler_params=compiler_params(4, 3), interpret=INTERPRET, name="fold_groups_stage2",
    )(acc_g, m_g, l_g, acc, m, l)
    return from_kv_heads(acc, m, l)


def one_program(o_part, lse_part, state, *, t):
    num_splits, batch, hkv, group, d = o_part.shape
    acc, m, l = by_kv_heads(state, hkv)

    def kernel(o_ref, lse_ref, acc_ref, m_ref, l_ref, acc_out, m_out, l_out):
        def body(j, carry):
            return _merge(carry, _group_state(o_ref, lse_ref, j * t, t))

        acc_out[...], m_out[...], l_out[...] = lax.fori_loop(0, num_splits // t, body,
                                                             (acc_ref[...], m_ref[...], l_ref[...]))

    row, stat = _specs(hkv, group, d)
    lead_row, lead_stat = _specs(hkv, group, d, lead=num_splits)
    acc, m, l = pl.pallas_call(
        kernel, grid=(batch * hkv, 1),
        in_specs=[lead_row, lead_stat, row, stat, stat],
        out_specs=[row, stat, stat],
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (acc, m, l)],
        compiler_params=compiler_params(4, 3), interpret=INTERPRET, name="fold_groups_one_program",
    )(o_part, lse_part[..., None], acc, m, l)
    return from_kv_heads(acc, m, l)


def library(o_part, lse_part, state):
    return pallas_kernels.fold_splits(state, o_part, lse_part)


def timed(fold, o_part, lse_part, state):
    @jax.jit
    def chain(o_part, lse_part, state):
        return lax.fori_loop(0, CHAIN, lambda i, s: fold(o_part, lse_part, s), state)

    one = jax.jit(fold)(o_part, lse_part, state)
    if INTERPRET:
        return one, {}
    jax.block_until_ready(chain(o_part, lse_part, state))
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(chain(o_part, lse_part, state))
        times.append((time.perf_counter() - start) / CHAIN * 1e6)
    return one, {"median_us": float(np.median(times)), "min_us": min(times), "max_us": max(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--splits", default="32,128")
    p.add_argument("--groups", default="1,4,8", help="splits a group (T)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    results = {"meta": run_metadata(), "rows": []}
    for splits in map(int, a.splits.split(",")):
        seed = 7 + splits
        rng = np.random.default_rng(seed)
        s, b, hkv, g, d = splits, 1, 8, 4, 128
        o_part = jnp.asarray(rng.standard_normal((s, b, hkv, g, d)), jnp.float32)
        lse = np.asarray(4 * rng.standard_normal((s, b, hkv, g)), np.float32)
        lse[rng.random(lse.shape) < 0.05] = -np.inf  # splits without keys
        lse_part = jnp.asarray(lse)
        state = AttentionState(jnp.asarray(rng.standard_normal((b, 1, hkv * g, d)), jnp.float32),
                               jnp.asarray(rng.standard_normal((b, hkv * g, 1)), jnp.float32),
                               jnp.asarray(rng.random((b, hkv * g, 1)) + 1, jnp.float32))
        lib, lib_time = timed(library, o_part, lse_part, state)
        row = {"splits": splits, "seed": seed, "library": lib_time}
        for t in map(int, a.groups.split(",")):
            two, two_time = timed(functools.partial(two_stages, t=t), o_part, lse_part, state)
            one, one_time = timed(functools.partial(one_program, t=t), o_part, lse_part, state)
            diff = float(jnp.max(jnp.abs(pallas_kernels.finish_state(two)[0] - pallas_kernels.finish_state(lib)[0])))
            row[f"groups of {t}"] = {
                "two_stages": two_time, "one_program": one_time,
                "two_stages_bits_equal_one_program": all(bool(jnp.array_equal(x, y)) for x, y in zip(two, one)),
                "bits_equal_library": all(bool(jnp.array_equal(x, y)) for x, y in zip(two, lib)),
                "max_abs_diff_library": diff}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
