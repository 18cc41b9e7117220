"""Issue 24: the Hopper sketch kernel with two token offsets a wgmma accumulator (query copies in columns 0-3 and
4-7 of N = 8, so a group of <= 4 heads wastes no softmax work on padding columns) against one offset an accumulator
(the engine's kernel at 56916e7, `mgpu_sketch._launch(pairs=1)`), in one call.

Checks: `probe_sketch_mgpu.check` for groups 4, 8 and 3 (the routed kernel against float64 NumPy). Timing: Llama-3.1-8B
shape, page 16, 30 sparse layers each with its own random sketch, GPU time of one pass over the 30 layers ((t4 - t1)
/ 3 of programs scoring them once and 4 times, medians of 20 waited calls), 5 alternated rounds, at 128K and 256K.
Writes probe_sketch_pairs.json under $OUT.

    MOSAIC_GPU_DUMP_PTXAS=1 python bench/probes/probe_sketch_pairs.py
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
import pallas_kernels  # noqa: E402
from bench.probes import probe_sketch_mgpu  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402
from common import run_metadata, stats  # noqa: E402

HKV, G, D, PAGE, LAYERS, PASSES, ROUNDS = 8, 4, 128, 16, 30, 4, 5
CONTEXTS = (131072, 262144)
SM_SCALE = D ** -0.5


def kernels(pages: int) -> dict:
    return {
        "one_offset_an_accumulator": lambda q, c, s: mgpu_sketch._launch(q, c, s, num_pages=pages, sm_scale=SM_SCALE,
                                                                           pairs=1),
        "two_offsets_an_accumulator": lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4),
    }


def main():
    path = Path(os.environ.get("OUT", "."), "probe_sketch_pairs.json")
    result = {**run_metadata(), "checks_vs_float64": [], "contexts": {}}
    for group, seed in ((4, 11), (8, 12), (3, 13)):
        result["checks_vs_float64"].append(probe_sketch_mgpu.check(group, seed))
        print(json.dumps(result["checks_vs_float64"][-1]), flush=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        fns = kernels(pages)
        words = [jax.lax.bitcast_convert_type(c.reshape(HKV, PAGE, pages, D // 8, 4), jnp.uint32) for c in codes]
        inputs = {name: (words, scales) for name in fns}
        runs = {(name, r): jax.jit(lambda q, c, s, f=f, r=r: [
            f(q[i] + jnp.bfloat16(j), c[i], s[i]) for j in range(r) for i in range(LAYERS)])
            for name, f in fns.items() for r in (1, PASSES)}
        for name in fns:
            jax.block_until_ready(runs[name, 1](q, *inputs[name]))
        per_pass = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name in fns:
                once, repeated = (lambda name=name, r=r: runs[name, r](q, *inputs[name]) for r in (1, PASSES))
                per_pass[name].append(common.gpu_ms_per_pass(once, repeated, PASSES, 20))
            print(tokens, json.dumps(per_pass), flush=True)
        result["contexts"][str(tokens)] = {
            "gpu_ms_per_pass_of_30_layers": {n: stats(v) for n, v in per_pass.items()}, "rounds": per_pass,
            "two_over_one_per_round": [
                a / b for a, b in zip(per_pass["two_offsets_an_accumulator"], per_pass["one_offset_an_accumulator"])]}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales, runs, words, inputs


if __name__ == "__main__":
    main()
