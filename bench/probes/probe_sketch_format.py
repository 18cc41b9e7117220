"""Issue 24: the Hopper sketch kernel reading int4 words (sign-magnitude codes widened by a rotate and an AND, a ring
of 4 tile slots) against the kernel before (int4 bytes in two's complement, all 16 tiles in shared memory:
`sketch_hopper_before.py`, the engine's at a747645) and the Triton kernel (int4 bytes, unchanged), in one call.

Checks: `probe_sketch_mgpu.check` (the engine's packing, groups of 4 and 8, a sketch allocated past the scored pages
with garbage there; the Hopper kernel over words, the Triton one over bytes, both against float64 NumPy). Timing:
Llama-3.1-8B shape, page 16, 30 sparse layers each with its own random sketch (the same bytes for every kernel), GPU
time of one pass over the 30 layers ((t4 - t1) / 3 of programs scoring them once and 4 times, medians of 20 waited
calls), 5 alternated rounds, at 128K and 256K. Writes probe_sketch_format.json under $OUT.

    MOSAIC_GPU_DUMP_PTXAS=1 python bench/probes/probe_sketch_format.py
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
from bench.probes import probe_sketch_mgpu, sketch_hopper_before  # noqa: E402
from common import run_metadata, stats  # noqa: E402
from pallas_kernels.sketch import default_launch  # noqa: E402

HKV, G, D, PAGE, LAYERS, PASSES, ROUNDS = 8, 4, 128, 16, 30, 4, 5
CONTEXTS = (131072, 262144)
SM_SCALE = D ** -0.5


def kernels(pages: int) -> dict:
    block_p, splits = default_launch(pages, HKV, PAGE)
    return {
        "hopper_before": lambda q, c, s: sketch_hopper_before.sketch_page_lse_mgpu(q, c, s),
        "hopper_after": lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4),
        "triton": lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4, block_p=block_p, splits=splits),
    }


def main():
    path = Path(os.environ.get("OUT", "."), "probe_sketch_format.json")
    result = {**run_metadata(), "checks_vs_float64": [], "contexts": {}}
    for group, seed in ((4, 11), (8, 12)):
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
        inputs = {name: (words if name == "hopper_after" else codes, scales) for name in fns}  # the same bytes
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
            "hopper_after_over_before_per_round": [
                a / b for a, b in zip(per_pass["hopper_after"], per_pass["hopper_before"])]}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales, runs, words, inputs


if __name__ == "__main__":
    main()
