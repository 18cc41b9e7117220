"""Device time of two parts of a sparse decode layer at 128K (issue 63), alone, on a GPU: choosing the pages (the
top 256 of 8,192 candidates per KV head, ascending) by XLA's top-k and sort against the sort-free Pallas kernel
(`pallas_kernels.top_k_ascending`, with its warps), and the page cache's copy of missed pages from pinned memory
(`pallas_kernels.copy_rows`, 2,048 rows of 8 KiB of which MISSES cross, with its warps). Each op runs CHAIN times in
one jitted program (each run's input depends on the last run's output), against the same program with one run: the
difference over CHAIN - 1 is one op's time, medians of REPEATS with min-max. Also checks that both choices give the
same pages. Writes probe_select_copy.json under $OUT.

    python bench/probes/probe_select_copy.py
"""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import probe_output, run_metadata, stats  # noqa: E402
from jax_offload.sparse import quest  # noqa: E402
from pallas_kernels import copy_rows, top_k_ascending  # noqa: E402

CHAIN, REPEATS = int(os.environ.get("CHAIN", 31)), int(os.environ.get("REPEATS", 7))
MISSES = int(os.environ.get("MISSES", 170))


def per_op_us(op, x0, *args) -> dict:
    """One op's device time: (CHAIN runs - 1 run) / (CHAIN - 1), each program timed REPEATS times. `args` go in as
    arguments (an array a program closes over becomes a constant in GPU memory: a pinned source would not be read
    over PCIe)."""
    def chain(n):
        def run(x, *args):
            for _ in range(n):
                x = op(x, *args)
            return x
        return jax.jit(run, donate_argnums=0)

    times = {}
    for n in (1, CHAIN):
        fn = chain(n)
        x = fn(x0(), *args)
        jax.block_until_ready(x)
        samples = []
        for _ in range(REPEATS):
            x = x0()
            jax.block_until_ready(x)
            t = time.perf_counter()
            jax.block_until_ready(fn(x, *args))
            samples.append(time.perf_counter() - t)
        times[n] = samples
    return stats([(a - b) / (CHAIN - 1) * 1e6 for a, b in zip(sorted(times[CHAIN]), sorted(times[1]))])


def main():
    result = {**run_metadata(), "chain": CHAIN, "repeats": REPEATS}
    rng = np.random.default_rng(0)
    select = {}
    for rows, n, k in ((8, 8192, 256), (64, 8192, 256), (8, 65536, 256), (8, 2048, 64)):
        score = jnp.asarray(rng.random((rows, n), np.float32))
        num_pages = jnp.int32(n - 3)

        def xla(s):
            p = quest.top_pages(s, num_pages, k, "xla")
            return s.at[:, 0].add(p[:, 1].astype(jnp.float32) * 1e-30)

        def pallas(s, warps=None):
            page = jnp.arange(n, dtype=jnp.int32)
            masked = jnp.where(page == 0, jnp.inf, jnp.where(page < num_pages, s, -jnp.inf))
            p = top_k_ascending(masked, k, **({} if warps is None else dict(num_warps=warps)))
            return s.at[:, 0].add(p[:, 1].astype(jnp.float32) * 1e-30)

        same = bool((np.asarray(quest.top_pages(score, num_pages, k, "xla"))
                     == np.asarray(quest.top_pages(score, num_pages, k, "pallas"))).all())
        entry = {"same_pages": same, "xla_top_k_sort_us": per_op_us(xla, lambda: score + 0)}
        for warps in (4, 8, 16):
            entry[f"pallas_{warps}_warps_us"] = per_op_us(lambda s: pallas(s, warps), lambda: score + 0)
        select[f"{rows}x{n}_top{k}"] = entry
        print(f"{rows}x{n} top {k}: {json.dumps(entry)}", flush=True)
    result["select"] = select

    # The page cache's copy: 8 KV heads x 256 chosen pages of 16 tokens (bf16, D 128: 8 KiB a row), MISSES of them
    # missing, from a pinned store layer of 8,192 pages a head into a cache of 1,092 slots a head.
    heads, pages, slots, chosen = 8, 8192, 1092, 256
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    src = jax.device_put(jnp.zeros((heads * pages, 2, 16, 128), jnp.bfloat16), pinned)
    src_rows = jnp.asarray(rng.integers(0, heads * pages, heads * chosen), jnp.int32)
    dst_rows = np.full(heads * chosen, heads * slots, np.int32)
    miss = rng.choice(heads * chosen, MISSES, replace=False)
    dst_rows[miss] = rng.choice(heads * slots, MISSES, replace=False)
    dst_rows = jnp.asarray(dst_rows)
    copy = {}
    for warps in (1, 2, 4, 8):
        copy[f"copy_rows_{warps}_warps_us"] = per_op_us(
            lambda d, s, r, w_rows, w=warps: copy_rows(d, s, r, w_rows, num_warps=w),
            lambda: jnp.zeros((heads * slots, 2, 16, 128), jnp.bfloat16), src, src_rows, dst_rows)
        print(warps, copy[f"copy_rows_{warps}_warps_us"], flush=True)
    result["copy"] = {"misses": MISSES, "bytes": MISSES * 2 * 16 * 128 * 2, **copy}
    probe_output("probe_select_copy.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
