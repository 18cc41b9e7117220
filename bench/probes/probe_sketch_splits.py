"""Sketch scoring with a page's token offsets split over several programs, on the GPU.

The kernel's programs each walk their pages' 16 token offsets one after another, and at 32K-128K tokens there are
only one or two waves of them (8 KV heads x P / 64 programs): `splits` programs per block of pages, each over
16 / splits offsets, their log-sum-exps combined after, fill the GPU more. Llama-3.1-8B shape (8 KV heads, 4 query
heads each, head dim 128), page 16, 30 sparse layers each with its own random int4 sketch, at 32K, 128K and 256K:
the kernel over (pages a program, warps, splits), 30 layers in one program, and each layer's page mass as the engine
takes it (kernel + `mass_of_pages`) at the best configuration and at the engine's default. Checks every split
against float64 NumPy on the GPU first. Median, min, max of 20 calls after a warm-up, each waited for. Writes
probe_sketch_splits.json under $OUT.

    python bench/probes/probe_sketch_splits.py
"""
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402

HKV, G, D, PAGE, LAYERS = 8, 4, 128, 16, 30
CONTEXTS = (32768, 131072, 262144)
CONFIGS = [(64, 4, 1), (64, 4, 2), (64, 4, 4), (64, 4, 8), (32, 4, 1), (32, 4, 2), (64, 2, 1), (64, 2, 2),
           (32, 2, 1), (64, 8, 2)]
HBM_BYTES_PER_S = 4.8e12  # H200


def timed(fn, reps=20):
    s = stats([t * 1e3 for t in call_seconds(fn, reps)])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def check():
    """Max |kernel - float64| / max |float64| per split count (8K tokens, a ragged last block of pages)."""
    rng = np.random.default_rng(11)
    t = 8192 - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    stored = (sketch.to_page_layout(sketch.pack_codes(codes, "int4"), PAGE), sketch.to_page_layout(scale, PAGE))
    q = jnp.asarray(rng.standard_normal((HKV, G, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, G, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    out = {}
    for splits in (1, 2, 4, 8):
        got = np.asarray(pallas_kernels.sketch_page_lse(q, *stored, bits=4, splits=splits), np.float64)
        out[f"splits{splits}"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    return out


def main():
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    result = {**run_metadata(), "kv_heads": HKV, "group": G, "head_dim": D, "page": PAGE, "layers": LAYERS,
              "check_max_rel_err_vs_float64": check(), "contexts": {}}
    print(json.dumps(result["check_max_rel_err_vs_float64"]), flush=True)
    path = Path(os.environ.get("OUT", "."), "probe_sketch_splits.json")
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        nbytes = sum(c.nbytes + s.nbytes for c, s in zip(codes, scales))
        rows = []
        for b, w, sp in CONFIGS:
            run = jax.jit(lambda q, c, s, b=b, w=w, sp=sp: [pallas_kernels.sketch_page_lse(
                q[i], c[i], s[i], bits=4, block_p=b, num_warps=w, splits=sp) for i in range(LAYERS)])
            rows.append({"block_p": b, "num_warps": w, "splits": sp, "x30": timed(lambda: run(q, codes, scales))})
            print(tokens, json.dumps(rows[-1]), flush=True)
        best = min(rows, key=lambda r: r["x30"]["median_ms"])
        num_pages = jnp.int32(pages)
        masses = {}
        for label, r in (("best", best), ("default", rows[0])):
            mass = jax.jit(lambda q, c, s, r=r: [sketch.mass_of_pages(pallas_kernels.sketch_page_lse(
                q[i], c[i], s[i], bits=4, block_p=r["block_p"], num_warps=r["num_warps"], splits=r["splits"]),
                num_pages) for i in range(LAYERS)])
            masses[label] = timed(lambda: mass(q, codes, scales))
        result["contexts"][str(tokens)] = {"sketch_bytes_30_layers": nbytes,
                                           "hbm_read_ms": nbytes / HBM_BYTES_PER_S * 1e3, "best": best,
                                           "page_mass_x30": masses, "rows": rows}
        print(tokens, "mass", json.dumps(masses), flush=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales


if __name__ == "__main__":
    main()
