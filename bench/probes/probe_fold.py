"""Probe: what bounds `fold_splits` at 32K (batch 1, 8 KV heads, 128 splits of 256 keys), whose data is 2 MB? It took
~42 us a call in the decode step before its loads went a step ahead (`bench/results/runs/h100_fold_prefetch/`). Times
the library kernel against variants of its loop, each bit-compared with the library's result: the statistics m and
l carried as [rows, 1] columns of the acc's 2-D layout, loads a step ahead, the head dim cut among several programs
per KV head, more or fewer splits a step, fewer warps. Each figure: a jitted chain of 64 dependent folds, median of 7
runs (min-max), per fold.

    python bench/probes/probe_fold.py --out probe_fold.json
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

CHAIN, RUNS = 64, 7


def column_fold(num_live, o_part, lse_part, acc, m, l, *, per_step, warps, stages, prefetch=False, col_blocks=1):
    """The library's fold with m, l and each split's lse as [rows, 1] columns: o_part [S, B, Hkv, G, D], lse_part
    [S, B, Hkv, G, 1], acc [B, Hkv, G, D], m and l [B, Hkv, G, 1]. With `prefetch` each loop step first issues the
    loads of the next step's splits, then folds the ones loaded the step before (their latency hidden). With
    `col_blocks` > 1 the head dim is cut among that many programs per KV head, each computing the same m and l
    (the same operations, the same bits) for its own columns of acc: more SMs, more loads in flight."""
    num_splits, batch, hkv, group, d = o_part.shape
    cols = d // col_blocks

    def kernel(live_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref, acc_out, m_out, l_out):
        acc, m, l = acc_ref[...], m_ref[...], l_ref[...]
        num_live = live_ref[()]

        def fold_one(carry, o, lse, live):
            acc, m, l = carry
            lse2 = lse * LOG2E
            m_new = jnp.maximum(m, lse2)
            m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
            w_old, w_new = jnp.exp2(m - m_use), jnp.exp2(lse2 - m_use)
            part = jnp.where(w_new > 0, w_new * o, 0.0)
            new = (acc * w_old + part, m_new, l * w_old + w_new)
            return tuple(jnp.where(live, x, y) for x, y in zip(new, carry))

        def load_step(i):
            first = i * per_step
            loaded = []
            for u in range(per_step):
                s = jnp.minimum(first + u, num_splits - 1)
                loaded.append((plgpu.load(o_ref.at[s]), plgpu.load(lse_ref.at[s])))
            return loaded

        def fold_step(i, carry, loaded):
            for u, (o, lse) in enumerate(loaded):
                carry = fold_one(carry, o, lse, i * per_step + u < num_live)
            return carry

        steps = (num_live + per_step - 1) // per_step
        if prefetch:
            def step(i, both):
                carry, loaded = both
                upcoming = load_step(i + 1)
                return fold_step(i, carry, loaded), upcoming

            (acc, m, l), _ = lax.fori_loop(0, steps, step, ((acc, m, l), load_step(0)))
        else:
            acc, m, l = lax.fori_loop(0, steps, lambda i, carry: fold_step(i, carry, load_step(i)), (acc, m, l))
        acc_out[...], m_out[...], l_out[...] = acc, m, l

    row = pl.BlockSpec((None, None, group, cols), lambda bh, c: (bh // hkv, bh % hkv, 0, c))
    stat = pl.BlockSpec((None, None, group, 1), lambda bh, c: (bh // hkv, bh % hkv, 0, 0))
    return pl.pallas_call(
        kernel, grid=(batch * hkv, col_blocks),
        in_specs=[pl.BlockSpec((None,), lambda bh, c: (bh // hkv,)),
                  pl.BlockSpec((num_splits, None, None, group, cols), lambda bh, c: (0, bh // hkv, bh % hkv, 0, c)),
                  pl.BlockSpec((num_splits, None, None, group, 1), lambda bh, c: (0, bh // hkv, bh % hkv, 0, 0)),
                  row, stat, stat],
        out_specs=[row, stat, stat],
        out_shape=[jax.ShapeDtypeStruct(acc.shape, jnp.float32), jax.ShapeDtypeStruct(m.shape, jnp.float32),
                   jax.ShapeDtypeStruct(l.shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=jax.default_backend() != "gpu",  # a CPU run checks the bits, its times mean nothing
        name="fold_columns",
    )(num_live, o_part, lse_part, acc, m, l)


def library(o_part, lse_part, state):
    return pallas_kernels.fold_splits(state, o_part, lse_part)


def columns(o_part, lse_part, state, **kw):
    num_splits, batch, hkv, group, d = o_part.shape
    acc, m, l = column_fold(jnp.full((batch,), num_splits, jnp.int32), o_part, lse_part[..., None],
                            state.acc.reshape(batch, hkv, group, d), state.m.reshape(batch, hkv, group, 1),
                            state.l.reshape(batch, hkv, group, 1), **kw)
    return AttentionState(acc.reshape(state.acc.shape), m.reshape(state.m.shape), l.reshape(state.l.shape))


def timed(fold, o_part, lse_part, state):
    @jax.jit
    def chain(o_part, lse_part, state):
        return lax.fori_loop(0, CHAIN, lambda i, s: fold(o_part, lse_part, s), state)

    one = jax.jit(fold)(o_part, lse_part, state)
    jax.block_until_ready(chain(o_part, lse_part, state))
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(chain(o_part, lse_part, state))
        times.append((time.perf_counter() - start) / CHAIN * 1e6)
    return one, {"median_us": float(np.median(times)), "min_us": min(times), "max_us": max(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--splits", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    seed = 5
    rng = np.random.default_rng(seed)
    s, b, hkv, g, d = a.splits, 1, 8, 4, 128
    o_part = jnp.asarray(rng.standard_normal((s, b, hkv, g, d)), jnp.float32)
    lse_part = jnp.asarray(4 * rng.standard_normal((s, b, hkv, g)), jnp.float32)
    state = AttentionState(jnp.asarray(rng.standard_normal((b, 1, hkv * g, d)), jnp.float32),
                           jnp.asarray(rng.standard_normal((b, hkv * g, 1)), jnp.float32),
                           jnp.asarray(rng.random((b, hkv * g, 1)) + 1, jnp.float32))
    variants = {"library": library}
    for per_step, warps, col_blocks in [(16, 4, 1), (16, 4, 2), (16, 4, 4), (16, 2, 4), (16, 1, 4), (16, 1, 8),
                                        (32, 1, 8), (8, 1, 8)]:
        variants[f"columns ({per_step} a step, {warps} warps, prefetch, {col_blocks} column blocks)"] = \
            functools.partial(columns, per_step=per_step, warps=warps, stages=3, prefetch=True, col_blocks=col_blocks)
    results, reference = {}, None
    for name, fold in variants.items():
        try:
            out, timing = timed(fold, o_part, lse_part, state)
        except Exception as err:  # a variant that does not lower is a finding, not the end of the probe
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(name, results[name]["error"], flush=True)
            continue
        if reference is None:
            reference = out
        same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(out, reference))
        results[name] = {**timing, "bits_equal_library": same}
        print(f"{name}: {timing['median_us']:.2f} us ({timing['min_us']:.2f}-{timing['max_us']:.2f}), "
              f"bits equal: {same}", flush=True)
    a.out.write_text(json.dumps({"meta": run_metadata(), "seed": seed, "shape": [s, b, hkv, g, d],
                                 "chain": CHAIN, "runs": RUNS, "variants": results}, indent=1))


if __name__ == "__main__":
    main()
