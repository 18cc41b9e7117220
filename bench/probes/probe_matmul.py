"""Probe: the batch-invariant Pallas matmul (pallas_kernels/matmul.py) on the GPU against XLA's (cuBLAS) dot, on
the projections of the Llama-3.1-8B and Qwen3-0.6B shapes (bf16). Each timing is one jitted scan over 4
different weights of the shape (as consecutive layers run), per matmul: median of 7 calls after a warm-up, with
min and max; the HBM floor reads the weight once at the device's copy rate. Bits: whether every launch config at
every M gives, row for row, the bits of the reference config's x[:8192] @ w.
  PYTHONPATH=. python bench/probes/probe_matmul.py   (JSON to $PROBE_OUT, or printed)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import call_seconds, run_metadata, stats  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402

SHAPES = {"8b.wqkv": (4096, 6144), "8b.wo": (4096, 4096), "8b.w_gate_up": (4096, 28672), "8b.w_down": (14336, 4096),
          "8b.lm_head": (4096, 128256), "0.6b.wqkv": (1024, 4096), "0.6b.wo": (2048, 1024),
          "0.6b.w_gate_up": (1024, 6144), "0.6b.w_down": (3072, 1024), "0.6b.lm_head": (1024, 151936)}
LAYERS = 4
DECODE = {"bm16_bn32_w4_s4": (16, 32, 4, 4), "bm16_bn64_w4_s4": (16, 64, 4, 4), "bm64_bn64_w4_s4": (64, 64, 4, 4),
          "bm16_bn32_w2_s6": (16, 32, 2, 6), "bm64_bn128_w4_s3": (64, 128, 4, 3)}
PREFILL = {"bm128_bn128_w8_s3": (128, 128, 8, 3), "bm128_bn256_w8_s3": (128, 256, 8, 3),
           "bm128_bn256_w8_s4": (128, 256, 8, 4), "bm256_bn128_w8_s3": (256, 128, 8, 3)}
REFERENCE = "bm128_bn128_w8_s3"
RUNS = {1: DECODE, 16: DECODE, 64: DECODE, 256: DECODE | PREFILL, 8192: PREFILL}


def copy_rate() -> float:
    x = jnp.ones((1 << 30) // 2, jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    return stats([2 * (1 << 30) / s for s in call_seconds(lambda: f(x), 7)])["median"]


same = jax.jit(lambda a, b: jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16)
                                    == jax.lax.bitcast_convert_type(b, jnp.uint16)))


def layers_fn(mm):
    """x, stacked weights [L, K, N] -> the L products [L, M, N], one scan step per weight."""
    return jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (c, mm(x, w)), 0, ws)[1])


cublas = layers_fn(lambda x, w: x @ w)
fns = {name: layers_fn(lambda x, w, c=c: matmul(x, w, block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3]))
       for name, c in (DECODE | PREFILL).items()}
out = {"meta": run_metadata(), "copy_bytes_per_s": copy_rate(), "layers_per_timing": LAYERS, "shapes": {}}
for name, (k, n) in SHAPES.items():
    ws = (jax.random.normal(jax.random.PRNGKey(0), (LAYERS, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    x_all = jax.random.normal(jax.random.PRNGKey(1), (8192, k), jnp.bfloat16)
    ref = fns[REFERENCE](x_all, ws)
    row = {"floor_ms": 2 * k * n / out["copy_bytes_per_s"] * 1e3, "ms": {}, "bits_equal_reference": {},
           "cublas_bits_equal_its_8192": {}}
    cub_ref = cublas(x_all, ws)
    for m, configs in RUNS.items():
        x = x_all[:m]
        t = {"cublas": stats([s * 1e3 / LAYERS for s in call_seconds(lambda: cublas(x, ws), 7)])}
        row["cublas_bits_equal_its_8192"][m] = bool(same(cublas(x, ws), cub_ref[:, :m]))
        for c in (c for c in configs if n % (DECODE | PREFILL)[c][1] == 0):
            t[c] = stats([s * 1e3 / LAYERS for s in call_seconds(lambda: fns[c](x, ws), 7)])
            row["bits_equal_reference"][f"{m}.{c}"] = bool(same(fns[c](x, ws), ref[:, :m]))
        row["ms"][m] = t
    out["shapes"][name] = row
    print(name, "floor %.3f" % row["floor_ms"], {m: {c: round(s["median"], 3) for c, s in t.items()}
                                                 for m, t in row["ms"].items()},
          "all bits equal:", all(row["bits_equal_reference"].values()), flush=True)
    del ws, x_all, ref, cub_ref
text = json.dumps(out, indent=1)
if os.environ.get("PROBE_OUT"):
    open(os.environ["PROBE_OUT"], "w").write(text)
