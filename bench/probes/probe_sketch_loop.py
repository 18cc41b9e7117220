"""The Hopper sketch kernel with its offsets walked by a loop of groups (pallas_kernels/mgpu_sketch.py: one group's code
in the instruction cache instead of 16 tiles unrolled) against the unrolled kernel (bench/probes/mgpu_sketch_v1.py),
on the GPU. Checks against float64 NumPy (group 4 and 8; 8K and 128K tokens less 3 pages in a sketch allocated for
more); timing: Llama-3.1-8B shape, page 16, int4, 30 sparse layers each with its own sketch, at CONTEXTS (default
32K, 128K, 256K): GPU time of one pass over the 30 layers ((t4 - t1) / 3 of programs scoring them once and 4 times,
medians of 20 waited calls each), 5 alternated rounds. Writes probe_sketch_loop.json under $OUT.

    MOSAIC_GPU_DUMP_PTXAS=1 python bench/probes/probe_sketch_loop.py
"""
import functools
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import mgpu_sketch_v1  # noqa: E402
from common import run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402

HKV, G, D, PAGE, LAYERS, PASSES, ROUNDS = 8, 4, 128, 16, 30, 4, 5
CONTEXTS = tuple(int(c) for c in os.environ.get("CONTEXTS", "32768,131072,262144").split(","))
SM_SCALE = 1 / math.sqrt(D)


def _v1(q, codes, scale, *, num_pages=None):
    return mgpu_sketch_v1._launch(q, codes, scale, num_pages=num_pages or codes.shape[2], sm_scale=SM_SCALE)


def _loop(q, codes, scale, *, num_pages=None, batch=4):
    return mgpu_sketch._launch(q, codes, scale, num_pages=num_pages or codes.shape[2], sm_scale=SM_SCALE, batch=batch)


KERNELS = {
    "wait_b4": _v1,
    **{f"loop_b{b}": functools.partial(_loop, batch=b) for b in (4, 2, 1)},
}


def check(group: int, tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t = tokens - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    stored = (sketch.to_page_layout(sketch.pack_codes(codes, "int4"), PAGE), sketch.to_page_layout(scale, PAGE))
    extra = tokens // PAGE + 64 - t // PAGE
    padded = (jnp.pad(stored[0], ((0, 0), (0, 0), (0, extra), (0, 0)), constant_values=0x5A),
              jnp.pad(stored[1], ((0, 0), (0, 0), (0, extra)), constant_values=7.0))
    q = jnp.asarray(rng.standard_normal((HKV, group, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, group, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    errs = {}
    for name, fn in list(KERNELS.items()):
        try:
            got = np.asarray(fn(q, *padded, num_pages=t // PAGE), np.float64)
        except Exception as e:  # a variant that does not compile leaves the others to be timed
            print(name, "failed:", repr(e)[-3000:], flush=True)
            del KERNELS[name]
            continue
        errs[name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    return {"seed": seed, "group": group, "tokens": tokens, "rel_err": errs, "ok": max(errs.values()) < 1e-6}


def main():
    checks = [check(4, 8192, 11), check(8, 8192, 12), check(4, 131072, 13)]
    print(json.dumps(checks), flush=True)
    result = {**run_metadata(), "checks_vs_float64": checks, "contexts": {}}
    path = Path(os.environ.get("OUT", "."), "probe_sketch_loop.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        runs = {(name, r): jax.jit(lambda q, c, s, f=f, r=r: [
            f(q[i] + jnp.bfloat16(j), c[i], s[i]) for j in range(r) for i in range(LAYERS)])
            for name, f in KERNELS.items() for r in (1, PASSES)}
        first = {name: np.asarray(runs[name, 1](q, codes, scales)[0]) for name in KERNELS}
        per_pass = {name: [] for name in KERNELS}
        for _ in range(ROUNDS):
            for name in KERNELS:
                once, repeated = (lambda name=name, r=r: runs[name, r](q, codes, scales) for r in (1, PASSES))
                per_pass[name].append(common.gpu_ms_per_pass(once, repeated, PASSES, 20))
            print(tokens, json.dumps(per_pass), flush=True)
        base = first["wait_b4"]
        result["contexts"][str(tokens)] = {
            "sketch_bytes_30_layers": sum(c.nbytes + s.nbytes for c, s in zip(codes, scales)),
            "gpu_ms_per_pass_of_30_layers": {n: stats(v) for n, v in per_pass.items()},
            "rounds": per_pass,
            "max_abs_diff_vs_wait_b4_layer0": {n: float(np.max(np.abs(v - base))) for n, v in first.items()}}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales, runs


if __name__ == "__main__":
    main()
