"""Probe: how much of the sketch kernel's time is its tensor-core work? The kernel multiplies each offset's [64 pages,
128] tile by the query group padded to N = 8 (wgmma's smallest N), 8 instructions m64n8k16 a tile. Timed against the
same kernel with every wgmma issued twice (twice the tensor-core work, nothing else changed; the scores are wrong, only
the time matters) and with the group padded to N = 16 (each instruction twice as wide). GPU ms per pass over 30 layers
at 256K as probe_sketch_mgpu.py measures it, 3 alternated rounds, XLA's chained read beside.

    python bench/probes/probe_sketch_mma_share.py --out DIR
"""
import argparse
import json
import sys
import types
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from common import run_metadata  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402
from probe_sketch_mgpu import REPEATS, gpu_ms_per_pass, xla_chained_reads  # noqa: E402

HKV, G, D, PAGE, LAYERS, ROUNDS = 8, 4, 128, 16, 30, 3
ORIGINAL_LAUNCH = mgpu_sketch._launch


def variant(name: str):
    module = types.ModuleType("plgpu_variant")
    module.__dict__.update(plgpu.__dict__)
    if name == "mma_twice":
        def twice(acc, a, b, **kw):
            plgpu.wgmma(acc, a, b, **kw)
            plgpu.wgmma(acc, a, b, **kw)
        module.wgmma = twice
    mgpu_sketch.plgpu = module
    mgpu_sketch._GROUP_PAD = 16 if name == "n16" else 8
    mgpu_sketch._launch = jax.jit(lambda *a, _w=ORIGINAL_LAUNCH.__wrapped__, **k: _w(*a, **k),
                                  static_argnames=("num_pages", "sm_scale"))
    return lambda q, c, s: mgpu_sketch.sketch_page_lse_mgpu(q, c, s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    tokens = 262144
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
    pages = tokens // PAGE
    codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
    scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
    runs, firsts = {}, {}
    for name in ("as_is", "mma_twice", "n16"):
        f = variant(name)
        for r in (1, REPEATS):
            runs[name, r] = jax.jit(lambda q, c, s, f=f, r=r: [
                f(q[i] + jnp.bfloat16(j), c[i], s[i]) for j in range(r) for i in range(LAYERS)]
                                    ).lower(q, codes, scales).compile()
        firsts[name] = runs[name, 1](q, codes, scales)[0]

    for r in (1, REPEATS):
        runs["xla_read", r] = jax.jit(lambda q, c, s, r=r: xla_chained_reads(c, s, r)).lower(q, codes, scales).compile()
    per_pass = gpu_ms_per_pass(runs, ("as_is", "mma_twice", "n16", "xla_read"), (q, codes, scales), ROUNDS)
    result = {**run_metadata(), "tokens": tokens, "gpu_ms_per_pass_of_30_layers_per_round": per_pass,
              "n16_equals_as_is": bool(jnp.array_equal(firsts["n16"], firsts["as_is"])),
              "mma_twice_minus_as_is_lse_max": float(jnp.abs(firsts["mma_twice"] - firsts["as_is"]).max())}
    print(json.dumps({k: v for k, v in result.items() if "equals" in k or "minus" in k}))
    path = Path(args.out, "probe_sketch_mma_share.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
