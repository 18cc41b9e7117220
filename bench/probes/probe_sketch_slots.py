"""The Hopper sketch kernel with fewer code tiles in flight and fewer offsets a wait: rings of 2, 3 or 4 tile slots a
CTA with 2 offsets a wait (4 and 2: the engine's), and 2 or 4 slots with 1 offset a wait (fewer registers). Checks each against float64 NumPy (probe_sketch_mgpu.check's data),
then times one pass over 30 layers of the Llama-3.1-8B shape at 128K and 256K as probe_sketch_mgpu does:
(t4 - t1) / 3 of programs scoring the 30 layers once and 4 times, medians of 20 waited calls, 5 alternated rounds.
Writes probe_sketch_slots.json under $OUT.

    python bench/probes/probe_sketch_slots.py
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

import common  # noqa: E402
from common import run_metadata  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402

HKV, G, D, PAGE, LAYERS, REPEATS, ROUNDS = 8, 4, 128, 16, 30, 4, 5
VARIANTS = ((4, 2), (2, 2), (3, 2), (2, 1), (4, 1))  # (tile slots, offsets a wait); (4, 2) is the engine's
NAMES = [f"slots{n}_wait{b}" for n, b in VARIANTS]


def score(q, codes, scale, variant, num_pages=None):
    slots, batch = variant
    return mgpu_sketch._launch(q, codes, scale, num_pages=num_pages or codes.shape[2], sm_scale=1 / math.sqrt(D),
                               tile_slots=slots, offsets_a_wait=batch)


def check(group: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t = 8192 - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    extra = 768 - t // PAGE
    words = jnp.pad(sketch.to_page_layout(sketch.pack_codes(codes, "int4", True), PAGE),
                    ((0, 0), (0, 0), (0, extra), (0, 0)), constant_values=0x5A)
    scales = jnp.pad(sketch.to_page_layout(scale, PAGE), ((0, 0), (0, 0), (0, extra)), constant_values=7.0)
    q = jnp.asarray(rng.standard_normal((HKV, group, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, group, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    out = {"seed": seed, "group": group}
    got = {n: np.asarray(score(q, words, scales, v, t // PAGE), np.float64) for n, v in zip(NAMES, VARIANTS)}
    for n in NAMES:
        out[f"{n}_rel_err"] = float(np.max(np.abs(got[n] - ref)) / np.max(np.abs(ref)))
        out[f"{n}_bits_equal_engine"] = bool(np.array_equal(got[n], got[NAMES[0]]))
    return out


def main():
    result = {**run_metadata(), "checks_vs_float64": [check(4, 11), check(8, 12)], "contexts": {}}
    print(json.dumps(result["checks_vs_float64"]), flush=True)
    path = Path(os.environ.get("OUT", "."), "probe_sketch_slots.json")
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in (131072, 262144):
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 8), jnp.uint32) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        runs = {(n, r): jax.jit(lambda q, c, s, v=v, r=r: [score(q[i] + jnp.bfloat16(j), c[i], s[i], v)
                                                           for j in range(r) for i in range(LAYERS)])
                for n, v in zip(NAMES, VARIANTS) for r in (1, REPEATS)}
        per_pass = {n: [] for n in NAMES}
        for _ in range(ROUNDS):
            for n in NAMES:
                per_pass[n].append(common.gpu_ms_per_pass(
                    lambda: runs[n, 1](q, codes, scales), lambda: runs[n, REPEATS](q, codes, scales), REPEATS, 20))
            print(tokens, json.dumps(per_pass), flush=True)
        result["contexts"][str(tokens)] = {
            "gpu_ms_per_pass_of_30_layers": per_pass,
            "median_min_max": {k: [float(np.median(v)), min(v), max(v)] for k, v in per_pass.items()}}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales


if __name__ == "__main__":
    main()
