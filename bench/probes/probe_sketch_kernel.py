"""Sketch scoring of all 30 sparse layers on the GPU, Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim
128), page 16, at 128K and 256K tokens: the Pallas kernel (each page's log-sum-exp) over a sweep of launch
configurations (pages per program, warps), against the HBM time of reading the 30 sketches.
`probe_sketch_kernel.h200.json` is from this sweep with two more switches, since made the kernel's only way: the
int4 codes unpacked by bit operations into float16, and the log-sum-exp in base 2 (together -14% at 256K).

Each layer has its own sketch (random codes and scales), so no layer's read is served from L2. Checks the compiled
kernel against the jnp path first, then times (median, min, max of 20 calls after a warm-up, each waited for) the
30 layers' kernels in one program, and, at the best configuration, the page mass the engine takes from them
(kernel, softmax over the pages, sum over the query group). Writes probe_sketch_kernel.json under $OUT.

    python bench/probes/probe_sketch_kernel.py
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels  # noqa: E402
from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402

HKV, G, D, PAGE, LAYERS = 8, 4, 128, 16, 30
CONTEXTS = (131072, 262144)
HBM_BYTES_PER_S = 4.8e12  # H200


def timed(fn, reps=20):
    """Median, min and max milliseconds of `reps` calls after a warm-up, each waited for."""
    s = stats([t * 1e3 for t in call_seconds(fn, reps)])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def random_sketches(tokens, dtype, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * LAYERS)
    pages = tokens // PAGE
    if dtype == "int4":
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
    else:
        codes = [jax.random.randint(k, (HKV, PAGE, pages, D), -127, 128, jnp.int8) for k in keys[:LAYERS]]
    scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
    return codes, scales


def check(dtype, bits):
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    q = jax.random.normal(key[0], (HKV, G, D), jnp.bfloat16)
    k = jax.random.normal(key[1], (HKV, 8192, D), jnp.bfloat16)
    codes, scale = sketch.quantize_keys(k, dtype)
    want = sketch.page_lse(sketch.token_scores(q, sketch.pack_codes(codes, dtype), scale, dtype), PAGE)
    packed, scale = sketch.to_page_layout(sketch.pack_codes(codes, dtype), PAGE), sketch.to_page_layout(scale, PAGE)
    worst = 0.0
    for warps in (4, 8):
        got = pallas_kernels.sketch_page_lse(q, packed, scale, bits=bits, num_warps=warps)
        worst = max(worst, float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))))
    return worst


def main():
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    result = {**run_metadata(), "kv_heads": HKV, "group": G,
              "head_dim": D, "page": PAGE, "layers": LAYERS, "contexts": {}}
    for dtype in ("int4", "int8"):
        bits = int(dtype[3:])
        result[f"{dtype}_max_rel_err_vs_jnp"] = check(dtype, bits)
        for tokens in CONTEXTS:
            codes, scales = random_sketches(tokens, dtype, tokens)
            nbytes = sum(c.nbytes + s.nbytes for c, s in zip(codes, scales))
            sweep = []
            for block_p, warps in ((64, 8), (32, 4), (64, 4)):
                fn = jax.jit(lambda q, c, s, b=block_p, w=warps: [pallas_kernels.sketch_page_lse(
                    q[i], c[i], s[i], bits=bits, block_p=b, num_warps=w) for i in range(LAYERS)])
                sweep.append({"block_p": block_p, "num_warps": warps, "x30": timed(lambda: fn(q, codes, scales))})
            sweep.sort(key=lambda r: r["x30"]["median_ms"])
            best = sweep[0]
            num_pages = jnp.int32(tokens // PAGE)
            mass = jax.jit(lambda q, c, s: [sketch.mass_of_pages(pallas_kernels.sketch_page_lse(
                q[i], c[i], s[i], bits=bits, block_p=best["block_p"], num_warps=best["num_warps"]), num_pages)
                for i in range(LAYERS)])
            row = {"sketch_bytes_30_layers": nbytes, "hbm_read_ms": nbytes / HBM_BYTES_PER_S * 1e3,
                   "best": best, "page_mass_x30_at_best": timed(lambda: mass(q, codes, scales)), "sweep": sweep}
            result["contexts"][f"{dtype}_{tokens}"] = row
            print(dtype, tokens, json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
            print(dtype, tokens, "next", json.dumps(sweep[1:4]), flush=True)
            del codes, scales
            if "OUT" in os.environ:  # after every context, so a run cut short still leaves what it measured
                Path(os.environ["OUT"], "probe_sketch_kernel.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
