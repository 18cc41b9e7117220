"""The Hopper sketch kernel with group g's wgmmas in flight while group g - 1's scores fold into the page log-sum-exp
(`mgpu_sketch._launch(pipelined=True)`), against the kernel that waits for each group's products before folding them
(pipelined=False), in the same call: both against float64 NumPy (probe_sketch_mgpu.check's case, groups 4 and 8), then
GPU ms of one pass over 30 layers of the Llama-3.1-8B shape (page 16, int4 words, random codes) at 128K and 256K,
(t4 - t1) / 3 of programs scoring the 30 layers once and 4 times, medians of 20 waited calls, 5 alternated rounds.
Writes probe_sketch_pipelined.json under $OUT."""
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

from common import gpu_ms_per_pass, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402

HKV, G, D, PAGE, LAYERS, PASSES = 8, 4, 128, 16, 30, 4


def check(group: int, seed: int, pipelined: bool) -> float:
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
    got = mgpu_sketch._launch(q, words, scales, num_pages=t // PAGE, sm_scale=1 / math.sqrt(D), pipelined=pipelined)
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def main():
    out = Path(os.environ.get("OUT", "."))
    result = {**run_metadata(), "checks_rel_err_vs_float64": {
        f"{'pipelined' if p else 'waiting'}_group{g}": check(g, 11 + g, p) for p in (False, True) for g in (4, 8)}}
    print(json.dumps(result["checks_rel_err_vs_float64"]), flush=True)
    q = jax.random.normal(jax.random.PRNGKey(1), (HKV, G, D), jnp.bfloat16)
    for tokens in (131072, 262144):
        pages = tokens // PAGE
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 8), jnp.uint32) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        progs = {}
        for name, p in (("waiting", False), ("pipelined", True)):
            def program(passes, p=p):
                return jax.jit(lambda q, c, s: [mgpu_sketch._launch(q + jnp.bfloat16(j), c[i], s[i], num_pages=pages,
                                                                    sm_scale=1 / math.sqrt(D), pipelined=p)
                                                for j in range(passes) for i in range(LAYERS)])
            progs[name] = (program(1), program(PASSES))
        a = progs["waiting"][0](q, codes, scales)[0]
        b = progs["pipelined"][0](q, codes, scales)[0]
        rounds = {n: [] for n in progs}
        for _ in range(5):
            for n, (once, rep) in progs.items():
                rounds[n].append(gpu_ms_per_pass(lambda: once(q, codes, scales), lambda: rep(q, codes, scales),
                                                 PASSES, 20))
            print(tokens, json.dumps(rounds), flush=True)
        result[str(tokens)] = {"max_abs_diff_pipelined_vs_waiting": float(jnp.max(jnp.abs(a - b))),
                               "rounds_ms": rounds, **{n: stats(v) for n, v in rounds.items()}}
        (out / "probe_sketch_pipelined.json").write_text(json.dumps(result, indent=1))
        del codes, scales


if __name__ == "__main__":
    main()
