"""Probe: launch parameters of the paged decode kernel at the batch shapes of nano-vllm's benchmark.

Qwen3-0.6B attention (16 query heads, 8 KV heads, D 128), bf16, KV pages of 256 tokens, batches of 256
and 64 sequences whose lengths are drawn like the benchmark's mid-run contexts (prompt uniform in
100..1024 plus a uniform share of an output uniform in 100..1024). For each (block_k, num_warps,
num_stages, num_splits) the kernel's time (median of 20 calls after warm-up, each waited for) against
its floor: the KV bytes it must read / the device's measured elementwise copy bandwidth. Prints one
line per config and writes probe_paged_decode.json under $OUT when set.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import GiB, call_seconds, run_metadata  # noqa: E402

import pallas_kernels  # noqa: E402

HQ, HKV, D, PAGE = 16, 8, 128, 256
gpu = jax.default_backend() == "gpu"


def copy_bandwidth(nbytes: int) -> float:
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2)
    return 2 * nbytes / statistics.median(call_seconds(lambda: double(x), 10))


def case(batch: int, rng: np.random.Generator):
    prompt = rng.integers(100, 1025, batch)
    out = rng.integers(100, 1025, batch)
    lens = (prompt + (rng.random(batch) * out).astype(int)).astype(np.int32)
    max_pages = -(-2048 // PAGE)
    num_pages = batch * max_pages
    table = rng.permutation(num_pages).reshape(batch, max_pages).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((num_pages, PAGE, HKV, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((num_pages, PAGE, HKV, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((batch, HQ, D)), jnp.bfloat16)
    return q, k, v, jnp.asarray(table), jnp.asarray(lens), int(lens.sum()) * HKV * D * 2 * 2


def main() -> None:
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(GiB if gpu else 2**24)
    grid = (itertools.product((32, 64, 128), (4, 8), (2, 3), (1, 2, 4)) if gpu
            else [(32, 4, 2, 1), (64, 4, 2, 2)])
    rows = []
    for batch in ((256, 64) if gpu else (4,)):
        q, k, v, table, lens, kv_bytes = case(batch, rng)
        floor = kv_bytes / bw
        for block_k, warps, stages, splits in grid:
            fn = jax.jit(lambda q, k, v, t, n, c=(block_k, warps, stages, splits): pallas_kernels.
                         paged_decode_attention_with_lse(q, k, v, t, n, block_k=c[0], num_warps=c[1],
                                                         num_stages=c[2], num_splits=c[3]))
            try:
                sec = statistics.median(call_seconds(lambda: fn(q, k, v, table, lens), 20 if gpu else 2))
            except Exception as e:  # a config Triton cannot build (shared memory): reported, not fatal
                rows.append({"batch": batch, "block_k": block_k, "num_warps": warps, "num_stages": stages,
                             "num_splits": splits, "error": str(e).splitlines()[0][:200]})
                print(batch, block_k, warps, stages, splits, "error", flush=True)
                continue
            rows.append({"batch": batch, "block_k": block_k, "num_warps": warps, "num_stages": stages,
                         "num_splits": splits, "seconds": sec, "floor_seconds": floor, "ratio": sec / floor})
            print(f"B={batch} block_k={block_k} warps={warps} stages={stages} splits={splits}: "
                  f"{sec * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms, x{sec / floor:.2f}", flush=True)
        default = jax.jit(pallas_kernels.paged_decode_attention_with_lse)
        sec = statistics.median(call_seconds(lambda: default(q, k, v, table, lens), 20 if gpu else 2))
        rows.append({"batch": batch, "default": True, "seconds": sec, "floor_seconds": floor, "ratio": sec / floor})
        print(f"B={batch} default: {sec * 1e3:.3f} ms, x{sec / floor:.2f}", flush=True)
    result = {"copy_bandwidth": bw, "rows": rows, "meta": run_metadata()}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_paged_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
