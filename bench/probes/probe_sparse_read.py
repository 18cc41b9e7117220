"""What a sketch step's reads of chosen pages cost at 128K by launch parameters (Llama-3.1-8B shape: 8 KV heads,
4 queries each, head dim 128, bf16; budget 4,096 tokens = 256 rows of 16 keys per KV head), 30 sparse layers in one
program, each layer its own random rows:
  attention over the chosen rows (`attention.attend_rows`' call of the paged kernel, each KV head's rows a "sequence")
  from the GPU cache and in place from the pinned store, by split count (16 is what `attend_rows` gets today);
  the page cache's copy of its misses (10% of the budget's rows, in place from the pinned store), by warps.
Median (min-max) of 20 timed runs after 3 warm-ups, ms for the 30 layers. Writes probe_sparse_read.json under $OUT.

    python bench/probes/probe_sparse_read.py
"""
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import probe_output, run_metadata  # noqa: E402
from pallas_kernels import paged_decode_attention_kv_with_lse  # noqa: E402
from pallas_kernels.copy_rows import copy_rows  # noqa: E402

HKV, GROUP, D, UNIT = 8, 4, 128, 16
LAYERS, BUDGET_ROWS = 30, 256
STORE_ROWS = 131072 // UNIT * HKV  # one layer's store at 128K
CACHE_ROWS = 1092 * HKV  # a 2 GiB cache's share of a layer
MISSES = BUDGET_ROWS * HKV // 10


def timed(fn, *args) -> dict:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def main():
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    row = (2, UNIT, 1, D)
    store = jax.device_put(jax.random.normal(jax.random.key(0), (STORE_ROWS, *row), jnp.bfloat16), pinned)
    cache = jax.random.normal(jax.random.key(1), (CACHE_ROWS, *row), jnp.bfloat16)
    qs = jax.random.normal(jax.random.key(2), (LAYERS, HKV, GROUP, D), jnp.bfloat16)

    def tables(num_rows):
        return jnp.asarray(np.stack([np.sort(rng.choice(num_rows, (HKV, BUDGET_ROWS), replace=True), axis=-1)
                                     for _ in range(LAYERS)]).astype(np.int32))

    store_tables, cache_tables = tables(STORE_ROWS), tables(CACHE_ROWS)
    seq_lens = jnp.full((HKV,), BUDGET_ROWS * UNIT, jnp.int32)

    def attention(num_splits):
        @jax.jit
        def run(qs, pool, tables):
            total = jnp.zeros((), jnp.float32)
            for layer in range(LAYERS):
                o, lse = paged_decode_attention_kv_with_lse(qs[layer], pool, tables[layer], seq_lens,
                                                           out_dtype=jnp.float32, num_splits=num_splits)
                total += o.sum() + lse.sum()
            return total
        return run

    results = {"attention_from_cache_ms": {}, "attention_from_store_ms": {}, "copy_ms": {}}
    for num_splits in (16, 32, 64, 128, 256):
        run = attention(num_splits)
        results["attention_from_cache_ms"][num_splits] = timed(run, qs, cache, cache_tables)
        results["attention_from_store_ms"][num_splits] = timed(run, qs, store, store_tables)
        print(num_splits, results["attention_from_cache_ms"][num_splits]["median"],
              results["attention_from_store_ms"][num_splits]["median"], flush=True)

    # Each layer: the budget's entries of every KV head, a tenth of them misses to copy, the others past the cache.
    src = jnp.asarray(rng.integers(0, STORE_ROWS, (LAYERS, BUDGET_ROWS * HKV)).astype(np.int32))
    dst = np.full((LAYERS, BUDGET_ROWS * HKV), CACHE_ROWS, np.int32)
    for layer in range(LAYERS):
        where = rng.choice(BUDGET_ROWS * HKV, MISSES, replace=False)
        dst[layer, where] = rng.choice(CACHE_ROWS, MISSES, replace=False)
    dst = jnp.asarray(dst)
    for num_warps in (1, 2, 4, 8):
        @jax.jit
        def copy(cache, store, src, dst):
            for layer in range(LAYERS):
                cache = copy_rows(cache, store, src[layer], dst[layer], num_warps=num_warps)
            return cache
        results["copy_ms"][num_warps] = timed(copy, cache, store, src, dst)
        print("copy", num_warps, results["copy_ms"][num_warps]["median"], flush=True)
    results["copy_bytes"] = LAYERS * MISSES * int(np.prod(row)) * 2
    probe_output("probe_sparse_read.json").write_text(json.dumps({"meta": run_metadata(), **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
