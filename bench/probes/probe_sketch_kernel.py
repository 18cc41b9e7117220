"""Sketch scoring of one layer on the GPU, Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim 128), 131,072
tokens, page 16: the Pallas kernel (each page's log-sum-exp) against the jnp path (token scores, then the same) and
the HBM time of reading the sketch.

Checks the compiled kernel against the jnp path on random keys, then times (median, min, max of 50 calls after a
warm-up, each waited for; the host's launch overhead included, so one call in a loop of 30 layers is also timed):
the kernel alone, the jnp path, and the whole page mass both ways, for int4 and int8, and a sweep of launch
configurations. Prints JSON; writes probe_sketch_kernel.json under $OUT.

    python bench/probes/probe_sketch_kernel.py
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402

HKV, G, D, T, PAGE = 8, 4, 128, 131072, 16


def timed(fn, reps=50):
    jax.block_until_ready(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(out), "min_ms": min(out), "max_ms": max(out)}


def main():
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    q = jax.random.normal(key[0], (HKV, G, D), jnp.bfloat16)
    k = jax.random.normal(key[1], (HKV, T, D), jnp.bfloat16)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tokens": T, "kv_heads": HKV,
              "group": G, "head_dim": D}
    num_pages = jnp.int32(T // PAGE)
    for dtype in ("int4", "int8"):
        codes, scale = jax.jit(sketch.quantize_keys, static_argnums=1)(k, dtype)
        packed = sketch.to_page_layout(sketch.pack_codes(codes, dtype), PAGE)
        scale = sketch.to_page_layout(scale, PAGE)
        bits = int(dtype[3:])
        kernel = jax.jit(lambda q, p, s: pallas_kernels.sketch_page_lse(q, p, s, bits=bits))
        ref = jax.jit(lambda q, p, s: sketch.page_lse(sketch.token_scores(
            q, sketch.from_page_layout(p), sketch.from_page_layout(s), dtype), PAGE))
        got, want = kernel(q, packed, scale), ref(q, packed, scale)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        pallas_mass = jax.jit(lambda q, p, s: sketch.mass_of_pages(pallas_kernels.sketch_page_lse(q, p, s, bits=bits),
                                                                   num_pages))
        jnp_mass = jax.jit(lambda q, p, s: sketch.mass_of_pages(ref(q, p, s), num_pages))
        layers30 = jax.jit(lambda q, p, s: [pallas_kernels.sketch_page_lse(q + i, p, s, bits=bits) for i in range(30)])
        nbytes = packed.nbytes + scale.nbytes
        result[dtype] = {
            "max_rel_err_vs_jnp": err, "sketch_bytes": nbytes,
            "hbm_read_ms_at_4TBps": nbytes / 4e12 * 1e3,
            "kernel": timed(lambda: kernel(q, packed, scale)),
            "kernel_x30_in_one_program": timed(lambda: layers30(q, packed, scale), reps=20),
            "jnp_page_lse": timed(lambda: ref(q, packed, scale)),
            "pallas_page_mass": timed(lambda: pallas_mass(q, packed, scale)),
            "jnp_page_mass": timed(lambda: jnp_mass(q, packed, scale)),
        }
        if dtype != "int4":
            print(dtype, json.dumps(result[dtype]), flush=True)
            continue
        # Launch configurations of the default dtype: pages per program, warps, pipeline stages.
        sweep = []
        for block_p in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2):
                    fn = jax.jit(lambda q, p, s, b=block_p, w=warps, n=stages: [pallas_kernels.sketch_page_lse(
                        q + i, p, s, bits=bits, block_p=b, num_warps=w, num_stages=n) for i in range(30)])
                    sweep.append({"block_p": block_p, "num_warps": warps, "num_stages": stages,
                                  "x30_in_one_program": timed(lambda: fn(q, packed, scale), reps=10)})
        result[dtype]["sweep"] = sorted(sweep, key=lambda r: r["x30_in_one_program"]["median_ms"])
        print(dtype, json.dumps({k: v for k, v in result[dtype].items() if k != "sweep"}), flush=True)
        print(dtype, "best", json.dumps(result[dtype]["sweep"][:4]), flush=True)
    text = json.dumps(result, indent=1)
    if "OUT" in os.environ:
        Path(os.environ["OUT"], "probe_sketch_kernel.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
