"""Does a warpgroup-MMA (wgmma) matmul bring the batch-invariant mode's prefill and 256-row decode matmuls to
cuBLAS (issue 64)? Our Triton-form matmul (pallas_kernels/matmul.py) takes 1.47x cuBLAS's time on the 8B projections
at 8,192 rows and 1.31x at 256 (runs/h200_invariant_price/prefill_tiles/).

For each 8B and Qwen3-0.6B projection at ROWS (default 256, 8192): ms per matmul (LAYERS distinct weights a program,
10 programs back to back, median of 7 loops with min-max: `common.matmul_ms`) of cuBLAS, the Triton form (default
launch parameters), our warpgroup form (pallas_kernels/mgpu_matmul.py) at a few tile configs, and JAX's own Hopper
matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu, K summed in one pass, no chunks: the speed a chunked form
can reach at most). Bits: our warpgroup form against the Triton form at every shape and row count (chunked K); JAX's
kernel against the Triton form at K = 1,536 (one chunk, where both sum K in one pass) at 64, 256 and 8,192 rows.
The first version of this probe (commit f77ff14) timed JAX's kernel only.

    python bench/probes/probe_matmul_hopper.py          # writes probe_matmul_hopper.json under $OUT
"""
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
# `matmul` below is the Triton form (the reference and "triton_default"); the warpgroup form is called by name.
os.environ["JAX_OFFLOAD_HOPPER_MATMUL"] = "0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper  # noqa: E402

from common import attempt, matmul_ms, probe_output, run_metadata  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402
from pallas_kernels.mgpu_matmul import mgpu_matmul  # noqa: E402

SHAPES = {"lm_head": (4096, 128256), "wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672),
          "w_down": (14336, 4096),
          "qwen3_0.6b.wqkv": (1024, 4096), "qwen3_0.6b.wo": (2048, 1024), "qwen3_0.6b.w_gate_up": (1024, 6144),
          "qwen3_0.6b.w_down": (3072, 1024)}
ROWS = [int(m) for m in os.environ.get("ROWS", "256,8192").split(",")]
M, N = hopper.MatmulDimension.M, hopper.MatmulDimension.N
CONFIGS = {  # JAX's kernel: (tile_m, tile_n, steps, wg_dimension, grid_minor_dim, grid_tile_width)
    "jax_t128x128_wgN_s4": (128, 128, 4, N, N, 8),
}
OURS = {  # mgpu_matmul: (tile_m, tile_n of each consumer warpgroup, split_rows, ring slots, cluster); 128 x 128
    # needs 256 registers a thread for its two float32 tiles; cluster "m"/"n": CTA pairs sharing w's / x's tiles
    "wg_rows_64x128_s6": (64, 128, True, 6, None), "wg_rows_64x128_s6_cm": (64, 128, True, 6, "m"),
    "wg_rows_64x128_s6_cn": (64, 128, True, 6, "n"), "wg_rows_64x128_s4_cm": (64, 128, True, 4, "m"),
    "wg_cols_128x64_s6_cm": (128, 64, False, 6, "m"), "wg_cols_128x64_s6_cn": (128, 64, False, 6, "n"),
    "wg_rows_64x64_s6": (64, 64, True, 6, None), "wg_cols_64x64_s6": (64, 64, False, 6, None),
    "wg_cols_64x64_s6_cm": (64, 64, False, 6, "m"), "wg_cols_64x64_s6_cn": (64, 64, False, 6, "n")}
if os.environ.get("OURS"):
    OURS = {k: v for k, v in OURS.items() if k in os.environ["OURS"].split(",")}
if os.environ.get("SHAPES"):
    SHAPES = {k: v for k, v in SHAPES.items() if k in os.environ["SHAPES"].split(",")}
if os.environ.get("NO_JAX_KERNEL"):
    CONFIGS = {}


def hopper_fn(name: str):
    tm, tn, steps, wg, minor, width = CONFIGS[name]
    cfg = hopper.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps, epi_tile_n=64,
                              epi_tile_m=64, grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
    return lambda x, w: hopper.matmul(x, w, None, cfg)


def bits_equal(a, b) -> bool:
    return bool(jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16) == jax.lax.bitcast_convert_type(b, jnp.uint16)))


result = {"meta": run_metadata(), "configs": {k: [str(v) for v in c] for k, c in CONFIGS.items()}, "bits": {},
          "ms": {}}
key = jax.random.PRNGKey(0)
for m in (64, 256, 8192) if CONFIGS else ():  # bits at one chunk of K
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
        # The engine's default multiplies a decode step's [B, 1, K] rows (decoder._dot), where XLA may pick other
        # cuBLAS kernels than for [B, K]: the engine's 256-row profile had two of its four layer kernels at ~24 and ~17
        # us (likely wqkv and wo), jnp.dot here 40.9 and 25.6 (runs/h200_invariant_price/price_2026_12_01/).
        times = {"cublas": matmul_ms(jnp.dot, x, ws),
                 "cublas_engine_rows": matmul_ms(lambda x, w: (x[:, None, :] @ w)[:, 0], x, ws),
                 "triton_default": matmul_ms(matmul, x, ws)}
        ref = jax.jit(matmul)(x, ws[0])
        for name, (tm, tn, split_rows, steps, cluster) in OURS.items():
            fn = functools.partial(mgpu_matmul, tile_m=tm, tile_n=tn, split_rows=split_rows, steps=steps,
                                   cluster=cluster)
            times[name] = attempt(lambda fn=fn: matmul_ms(fn, x, ws))
            result["bits"][f"{sname}.{m}.{name}"] = attempt(
                lambda fn=fn: {"bits_equal": bits_equal(jax.jit(fn)(x, ws[0]), ref)})
        for name in CONFIGS:
            times[name] = attempt(lambda name=name: matmul_ms(hopper_fn(name), x, ws))
        result["ms"][f"{sname}.{m}"] = times
        print(sname, m, {n: round(t["median"], 4) if "median" in t else t["error"][:80] for n, t in times.items()},
              {n: result["bits"][f"{sname}.{m}.{n}"] for n in OURS}, flush=True)
        probe_output("probe_matmul_hopper.json").write_text(json.dumps(result, indent=1))
        del ws
