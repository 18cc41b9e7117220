"""Could a warpgroup-MMA (wgmma) matmul bring the batch-invariant mode's prefill and 256-row decode matmuls to cuBLAS
(issue 64)? Our Triton-form matmul (pallas_kernels/matmul.py) takes 1.47x cuBLAS's time on the 8B projections at
8,192 rows and 1.31x at 256 (runs/h200_invariant_price/prefill_tiles/). JAX's own Hopper matmul
(jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu: TMA loads, warp-specialized pipeline, two consumer warpgroups)
sums K in one pass, not in our 1,024-key chunks, so it is the speed a chunked wgmma form could reach at most.

For each 8B projection at ROWS (default 256, 8192): ms per matmul (LAYERS distinct weights a program, CALLS
programs back to back, median of 7 loops with min-max) of cuBLAS, our default and the Hopper kernel at a few tile
configs. Bits: at K = 1,536 (one chunk, so our matmul sums K in one pass too) the Hopper kernel's output against
ours, bit for bit, at 64, 256 and 8,192 rows: equal bits would let a wgmma form keep today's decode bits.

    python bench/probes/probe_matmul_hopper.py          # writes probe_matmul_hopper.json under $OUT
"""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper  # noqa: E402

from common import probe_output, run_metadata, stats  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402

SHAPES = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672), "w_down": (14336, 4096)}
ROWS = [int(m) for m in os.environ.get("ROWS", "256,8192").split(",")]
CALLS, LOOPS = 10, 7
M, N = hopper.MatmulDimension.M, hopper.MatmulDimension.N
CONFIGS = {  # (tile_m, tile_n, steps, wg_dimension, grid_minor_dim, grid_tile_width)
    "t128x128_wgN_s4": (128, 128, 4, N, N, 8),
    "t128x128_wgM_s4": (128, 128, 4, M, N, 8),
    "t64x128_wgN_s4": (64, 128, 4, N, N, 8),
    "t64x256_wgN_s3": (64, 256, 3, N, N, 8),
}


def hopper_fn(name: str):
    tm, tn, steps, wg, minor, width = CONFIGS[name]
    cfg = hopper.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps, epi_tile_n=64,
                              epi_tile_m=64, grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
    return lambda x, w: hopper.matmul(x, w, None, cfg)


def per_matmul_ms(fn, x, ws) -> dict:
    jax.block_until_ready(fn(x, ws))
    samples = []
    for _ in range(LOOPS):
        t = time.perf_counter()
        jax.block_until_ready([fn(x, ws) for _ in range(CALLS)])
        samples.append((time.perf_counter() - t) * 1e3 / (CALLS * len(ws)))
    return stats(samples)


def program(mm):
    return jax.jit(lambda x, ws: [mm(x, w) for w in ws])


def bits_equal(a, b) -> bool:
    return bool(jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16) == jax.lax.bitcast_convert_type(b, jnp.uint16)))


def attempt(fn):
    try:
        return fn()
    except Exception as e:  # a tile config the kernel refuses (shape, shared memory): recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


result = {"meta": run_metadata(), "configs": {k: [str(v) for v in c] for k, c in CONFIGS.items()}, "bits": {},
          "ms": {}}
key = jax.random.PRNGKey(0)
for m in (64, 256, 8192):  # bits at one chunk of K
    x = jax.random.normal(jax.random.fold_in(key, m), (m, 1536), jnp.bfloat16)
    w = (jax.random.normal(key, (1536, 1024), jnp.float32) * 0.02).astype(jnp.bfloat16)
    ours = jax.jit(matmul)(x, w)
    for name in CONFIGS:
        def check(name=name):
            got = jax.jit(hopper_fn(name))(x, w)
            return {"bits_equal": bits_equal(got, ours),
                    "max_abs_diff": float(jnp.max(jnp.abs(got.astype(jnp.float32) - ours.astype(jnp.float32))))}
        result["bits"][f"{m}.{name}"] = attempt(check)
    print("bits", m, {n: result["bits"][f"{m}.{n}"] for n in CONFIGS}, flush=True)
probe_output("probe_matmul_hopper.json").write_text(json.dumps(result, indent=1))

for sname, (k, n) in SHAPES.items():
    for m in ROWS:
        layers = 4 if m > 512 else 16
        ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
              for i in range(layers)]
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
        times = {"cublas": per_matmul_ms(program(jnp.dot), x, ws), "ours_default": per_matmul_ms(program(matmul), x, ws)}
        for name in CONFIGS:
            times[name] = attempt(lambda name=name: per_matmul_ms(program(hopper_fn(name)), x, ws))
        result["ms"][f"{sname}.{m}"] = times
        print(sname, m, {n: round(t["median"], 4) if "median" in t else t["error"][:80] for n, t in times.items()},
              flush=True)
        probe_output("probe_matmul_hopper.json").write_text(json.dumps(result, indent=1))
        del ws
