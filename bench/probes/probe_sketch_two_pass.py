"""Sketch scoring: the page log-sum-exp kernel with its online softmax (a running max and sum carried from one
token offset to the next) against two passes (every offset's scores first, then one max and one sum), on the GPU.

The kernel's time follows the number of programs in flight, not bytes (`pallas_kernels/sketch.py`): each program's
16 offsets form one dependent chain through the running max. With two passes the offsets' loads and dots depend on
nothing but the query, so they may all be in flight at once. Llama-3.1-8B shape (8 KV heads, 4 query heads each,
head dim 128), page 16, int4, 30 sparse layers each with its own random sketch in one program, at 32K, 128K and
256K, the engine's default launch; float64 check of both first. Median, min, max of 20 calls after a warm-up.
Writes probe_sketch_two_pass.json under $OUT (or --out).

    python bench/probes/probe_sketch_two_pass.py
"""
import argparse
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


def check(interpret: bool) -> dict:
    """Max |kernel - float64| / max |float64| (a ragged last block of pages)."""
    rng = np.random.default_rng(12)
    t = (2048 if interpret else 8192) - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    stored = (sketch.to_page_layout(sketch.pack_codes(codes, "int4"), PAGE), sketch.to_page_layout(scale, PAGE))
    q = jnp.asarray(rng.standard_normal((HKV, G, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, G, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    out = {}
    for two_pass in (False, True):
        got = np.asarray(pallas_kernels.sketch_page_lse(q, *stored, bits=4, two_pass=two_pass, interpret=interpret),
                         np.float64)
        out[f"two_pass={two_pass}"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check-only", action="store_true", help="the float64 check alone (CPU: interpret mode)")
    args = ap.parse_args()
    result = {"meta": run_metadata(), "max_rel_err_vs_float64": check(args.check_only)}
    print(result["max_rel_err_vs_float64"], flush=True)
    if not args.check_only:
        keys = iter(jax.random.split(jax.random.key(0), 3 * LAYERS * len(CONTEXTS)))
        for ctx in CONTEXTS:
            p = ctx // PAGE
            codes = [jax.random.bits(next(keys), (HKV, PAGE, p, D // 2), jnp.uint8) for _ in range(LAYERS)]
            scales = [jax.random.uniform(next(keys), (HKV, PAGE, p)) * 0.1 for _ in range(LAYERS)]
            q = jax.random.normal(next(keys), (HKV, G, D), jnp.bfloat16)
            row = result.setdefault("contexts", {}).setdefault(str(ctx), {})
            for two_pass in (False, True, False, True):  # alternated twice: drift shows
                run = jax.jit(lambda q, c, s, tp=two_pass: [pallas_kernels.sketch_page_lse(
                    q, ci, si, bits=4, two_pass=tp) for ci, si in zip(c, s)])
                st = stats([t * 1e3 for t in call_seconds(lambda: run(q, codes, scales), 20)])
                row.setdefault("two_pass" if two_pass else "online", []).append(
                    {"median_ms": st["median"], "min_ms": st["min"], "max_ms": st["max"]})
                print(ctx, "two_pass" if two_pass else "online", f"{st['median']:.3f} ms ({st['min']:.3f}-{st['max']:.3f})",
                      flush=True)
            del codes, scales
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "probe_sketch_two_pass.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
