"""Probe: how many splits should `fold_splits` load a loop step? It loaded 16 a step (32 tiles held, the next step
prefetched) whatever the call; a workload's decode step folds 256 sequences of one or two splits, where that many
registers a program cost occupancy. Times the library's `_fold` at each splits-per-step (1..16) for the shapes the
engine folds (Llama-3.1-8B: 8 KV heads x 4 query rows; Qwen3-0.6B: 8 x 2; D 128): batch 256 at 1-2 splits (the
nano-vllm workload), batch 1 at 8-128 splits (8K-128K of 1,024-key splits). Each result is bit-compared with 16 a
step's. Figures: a jitted chain of 64 dependent folds, median of 7 runs (min-max), us per fold. On a CPU it only
checks the bits.

    python bench/probes/probe_fold_steps.py --out $OUT/fold_steps.json
"""
import argparse
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

from common import run_metadata  # noqa: E402
from pallas_kernels import fold  # noqa: E402

CHAIN, RUNS = 64, 7
CASES = [(256, 4, 1), (256, 4, 2), (64, 4, 2), (256, 2, 1), (256, 2, 2), (1, 4, 8), (1, 4, 64), (1, 4, 128)]
HKV, D = 8, 128


def timed(fn, *args):
    chain = jax.jit(lambda live, o, lse, acc, m, l: lax.fori_loop(0, CHAIN, lambda i, s: fn(live, o, lse, *s),
                                                                   (acc, m, l)))
    one = jax.block_until_ready(jax.jit(fn)(*args))
    if jax.default_backend() != "gpu":
        return one, {}
    jax.block_until_ready(chain(*args))
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(chain(*args))
        times.append((time.perf_counter() - start) / CHAIN * 1e6)
    return one, {"median_us": float(np.median(times)), "min_us": min(times), "max_us": max(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    rows = []
    for seed, (batch, group, splits) in enumerate(CASES):
        rng = np.random.default_rng(seed)
        o = jnp.asarray(rng.standard_normal((splits, batch, HKV, group, D)), jnp.float32)
        lse = jnp.asarray(rng.standard_normal((splits, batch, HKV, group, 1)) * 4, jnp.float32)
        live = jnp.asarray(rng.integers(1, splits + 1, batch), jnp.int32)
        acc = jnp.zeros((batch, HKV, group, D), jnp.float32)
        m = jnp.full((batch, HKV, group, 1), -jnp.inf, jnp.float32)
        l = jnp.zeros((batch, HKV, group, 1), jnp.float32)
        results = {}
        for per_step in (16, 8, 4, 2, 1):
            fn = lambda live, o, lse, acc, m, l, k=per_step: fold._fold(  # noqa: E731
                live, o, lse, acc, m, l, tree=1, per_step=k, interpret=jax.default_backend() != "gpu")
            out, t = timed(fn, live, o, lse, acc, m, l)
            ref = results.get(16, (out,))[0]
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(out, ref))
            results[per_step] = (out, t)
            row = dict(batch=batch, group=group, splits=splits, per_step=per_step, library=fold._splits_per_step(splits, 1),
                       bits_equal_16=same, seed=seed, **t)
            rows.append(row)
            print(json.dumps(row), flush=True)
        a.out.write_text(json.dumps({"meta": run_metadata(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
