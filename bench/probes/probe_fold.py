"""Probe: can `fold_splits` keep its bits and lose its chain? After its loads went a step ahead it still takes
~150 ns a split (`bench/results/runs/h100_fold_prefetch/`), bound by dependent operations. Times the library kernel
against variants that do the very same float operations per element in another arrangement, each bit-compared
with the library's result:
- `hoisted`: each loop step first runs its 16 splits' running max (the only chain through m), then all their exp2
  weights (independent of each other), then the multiply-adds of acc and l (the chains that must stay);
- `wide`: lse, m and l carried as [rows, D] (every column the same value) so that no value changes layout between
  a row statistic and the acc it scales (Triton converts a [rows] vector through shared memory to broadcast it);
- both, and both with the head dim cut among 4 programs per KV head;
- `tree T` (the library's `fold_splits(..., tree=T)`): groups of T splits merged pairwise, groups in order, another
  order by design, so its bits differ from the sequential fold's; it reports the largest difference of the
  normalised outputs against the library's instead (float32 rounding, ~1e-6).
Each figure: a jitted chain of 64 dependent folds, median of 7 runs (min-max), per fold, batch 1, 8 KV heads, 4
query rows each, D 128, at 128 and 256 splits (32K and 64K of 256-key splits). On a CPU it only checks the bits.

    python bench/probes/probe_fold.py --out $OUT/probe_fold.json
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
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from common import run_metadata  # noqa: E402
import pallas_kernels  # noqa: E402
from pallas_kernels._common import LOG2E, NEG_INF  # noqa: E402
from pallas_kernels.state import AttentionState  # noqa: E402

CHAIN, RUNS, PER_STEP = 64, 7, 16


def variant_fold(num_live, o_part, lse_part, acc, m, l, *, hoist, col_blocks, warps):
    """o_part [S, B, Hkv, G, D]; lse_part, m and l either [S, B, Hkv, G, 1] / [B, Hkv, G, 1] (narrow) or broadcast
    over D (wide); acc [B, Hkv, G, D]. The library's operations per element, in the order `hoist` says."""
    num_splits, batch, hkv, group, d = o_part.shape
    cols, stat_cols = d // col_blocks, (d // col_blocks if lse_part.shape[-1] == d else 1)

    def kernel(live_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref, acc_out, m_out, l_out):
        acc, m, l = acc_ref[...], m_ref[...], l_ref[...]
        num_live = live_ref[()]

        def load_step(i):
            return [(plgpu.load(o_ref.at[jnp.minimum(i * PER_STEP + u, num_splits - 1)]),
                     plgpu.load(lse_ref.at[jnp.minimum(i * PER_STEP + u, num_splits - 1)])) for u in range(PER_STEP)]

        def fold_step(i, carry, loaded):
            acc, m, l = carry
            if not hoist:
                for u, (o, lse) in enumerate(loaded):
                    live = i * PER_STEP + u < num_live
                    lse2 = lse * LOG2E
                    m_new = jnp.maximum(m, lse2)
                    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
                    w_old, w_new = jnp.exp2(m - m_use), jnp.exp2(lse2 - m_use)
                    part = jnp.where(w_new > 0, w_new * o, 0.0)
                    acc = jnp.where(live, acc * w_old + part, acc)
                    l = jnp.where(live, l * w_old + w_new, l)
                    m = jnp.where(live, m_new, m)
                return acc, m, l
            lives = [i * PER_STEP + u < num_live for u in range(PER_STEP)]
            ms, lse2s = [m], []
            for (o, lse), live in zip(loaded, lives):
                lse2s.append(lse * LOG2E)
                ms.append(jnp.where(live, jnp.maximum(ms[-1], lse2s[-1]), ms[-1]))
            weights = []
            for u, (o, lse) in enumerate(loaded):
                m_new = jnp.maximum(ms[u], lse2s[u])
                m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
                w_new = jnp.exp2(lse2s[u] - m_use)
                weights.append((jnp.exp2(ms[u] - m_use), w_new, jnp.where(w_new > 0, w_new * o, 0.0)))
            for (w_old, w_new, part), live in zip(weights, lives):
                acc = jnp.where(live, acc * w_old + part, acc)
                l = jnp.where(live, l * w_old + w_new, l)
            return acc, ms[-1], l

        def step(i, both):
            carry, loaded = both
            upcoming = load_step(i + 1)
            return fold_step(i, carry, loaded), upcoming

        steps = (num_live + PER_STEP - 1) // PER_STEP
        (acc, m, l), _ = lax.fori_loop(0, steps, step, ((acc, m, l), load_step(0)))
        acc_out[...], m_out[...], l_out[...] = acc, m, l

    row = pl.BlockSpec((None, None, group, cols), lambda bh, c: (bh // hkv, bh % hkv, 0, c))
    stat = pl.BlockSpec((None, None, group, stat_cols),
                        lambda bh, c: (bh // hkv, bh % hkv, 0, c if stat_cols > 1 else 0))
    return pl.pallas_call(
        kernel, grid=(batch * hkv, col_blocks),
        in_specs=[pl.BlockSpec((None,), lambda bh, c: (bh // hkv,)),
                  pl.BlockSpec((num_splits, None, None, group, cols), lambda bh, c: (0, bh // hkv, bh % hkv, 0, c)),
                  pl.BlockSpec((num_splits, None, None, group, stat_cols),
                               lambda bh, c: (0, bh // hkv, bh % hkv, 0, c if stat_cols > 1 else 0)),
                  row, stat, stat],
        out_specs=[row, stat, stat],
        out_shape=[jax.ShapeDtypeStruct(acc.shape, jnp.float32), jax.ShapeDtypeStruct(m.shape, jnp.float32),
                   jax.ShapeDtypeStruct(l.shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=3),
        interpret=jax.default_backend() != "gpu",  # a CPU run checks the bits, its times mean nothing
        name="fold_variant",
    )(num_live, o_part, lse_part, acc, m, l)


def library(o_part, lse_part, state, tree=1):
    return pallas_kernels.fold_splits(state, o_part, lse_part, tree=tree)


def variant(o_part, lse_part, state, *, wide, **kw):
    num_splits, batch, hkv, group, d = o_part.shape
    width = d if wide else 1
    stat = lambda x: jnp.broadcast_to(x[..., None], (*x.shape, width))  # noqa: E731
    acc, m, l = variant_fold(jnp.full((batch,), num_splits, jnp.int32), o_part, stat(lse_part),
                             state.acc.reshape(batch, hkv, group, d), stat(state.m.reshape(batch, hkv, group)),
                             stat(state.l.reshape(batch, hkv, group)), **kw)
    return AttentionState(acc.reshape(state.acc.shape), m[..., 0].reshape(state.m.shape),
                          l[..., 0].reshape(state.l.shape))


def timed(fold, o_part, lse_part, state):
    @jax.jit
    def chain(o_part, lse_part, state):
        return lax.fori_loop(0, CHAIN, lambda i, s: fold(o_part, lse_part, s), state)

    one = jax.jit(fold)(o_part, lse_part, state)
    if jax.default_backend() != "gpu":
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
    p.add_argument("--splits", default="128,256")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    variants = {"library": library}
    for wide in (False, True):
        for hoist in (False, True):
            variants[f"{'wide' if wide else 'narrow'}, {'hoisted' if hoist else 'in order'}"] = functools.partial(
                variant, wide=wide, hoist=hoist, col_blocks=1, warps=4)
    variants["wide, hoisted, 4 column blocks, 1 warp"] = functools.partial(variant, wide=True, hoist=True,
                                                                           col_blocks=4, warps=1)
    for tree in (4, 8, 16):
        variants[f"tree {tree}"] = functools.partial(library, tree=tree)
    results = {"meta": run_metadata()}
    for splits in [int(s) for s in a.splits.split(",")]:
        seed = 5
        rng = np.random.default_rng(seed)
        s, b, hkv, g, d = splits, 1, 8, 4, 128
        o_part = jnp.asarray(rng.standard_normal((s, b, hkv, g, d)), jnp.float32)
        lse_part = jnp.asarray(4 * rng.standard_normal((s, b, hkv, g)), jnp.float32)
        state = AttentionState(jnp.asarray(rng.standard_normal((b, 1, hkv * g, d)), jnp.float32),
                               jnp.asarray(rng.standard_normal((b, hkv * g, 1)), jnp.float32),
                               jnp.asarray(rng.random((b, hkv * g, 1)) + 1, jnp.float32))
        reference = None
        for name, fold in variants.items():
            try:
                out, timing = timed(fold, o_part, lse_part, state)
            except Exception as err:  # a variant that does not lower is a finding, not the end of the probe
                results[f"{splits} splits, {name}"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                print(splits, name, "error", str(err)[:300], flush=True)
                continue
            reference = out if reference is None else reference
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(out, reference))
            o_out, o_ref = (pallas_kernels.finish_state(x)[0] for x in (out, reference))
            diff = float(jnp.max(jnp.abs(o_out - o_ref)))
            results[f"{splits} splits, {name}"] = {**timing, "bits_equal_library": same, "max_abs_diff": diff,
                                                   "seed": seed}
            print(splits, name, timing, "bits equal:", same, "max |diff|:", diff, flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
