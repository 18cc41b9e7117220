"""Do wide weights summing K in one pass for generated tokens (matmul.ONE_PASS_N) close the 8B workload's matmul gap
(issue 64)? A 256-row decode step's w_gate_up took 115 us in the chunked order against cuBLAS's 94, its LM head 506
against 436 (runs/h200_invariant_price/, 60th session): two float32 tiles a consumer cap a CTA at 128 x 128 outputs.
In one pass a consumer holds one, so wider CTAs fit.

For w_gate_up and the LM head of the 8B shape at ROWS (default 1, 64, 128, 256): us per matmul (distinct weights a
program, `common.matmul_ms`) of cuBLAS (the engine's [B, 1, K] rows), the chunked order as before (warpgroup form,
its old decode tiles; Triton's one-row form at 1 row), the library now (`matmul`, one pass) and the warpgroup form in
one pass at several CTA shapes. Bits: each one-pass output against the Triton form's one pass over the same rows
(launch parameters given: the Triton form), and its first row against that row multiplied alone.

    python bench/probes/probe_matmul_wide_one_pass.py     # writes probe_matmul_wide_one_pass.json under $OUT
"""
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import attempt, matmul_ms, probe_output, run_metadata  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402
from pallas_kernels.mgpu_matmul import mgpu_matmul  # noqa: E402

matmul_module, mgpu_module = sys.modules["pallas_kernels.matmul"], sys.modules["pallas_kernels.mgpu_matmul"]

SHAPES = {"w_gate_up": ((4096, 28672), 16), "lm_head": ((4096, 128256), 6)}  # (K, N), distinct weights a program
ROWS = [int(m) for m in os.environ.get("ROWS", "1,64,128,256").split(",")]
ONE_PASS = {  # mgpu_matmul tiles: (tile_m, tile_n of each consumer warpgroup, split_rows) -> a CTA's rows x columns
    "rows_64x128": (64, 128, True),     # 128 x 128 (the decode tiles)
    "cols_64x64": (64, 64, False),      # 64 x 128 (the decode tiles while one wave holds them)
    "cols_64x128": (64, 128, False),    # 64 x 256
    "rows_64x256": (64, 256, True),     # 128 x 256
    "cols_128x128": (128, 128, False),  # 128 x 256 (the prefill tiles)
    "rows_128x128": (128, 128, True),   # 256 x 128
}
if os.environ.get("ONE_PASS"):
    ONE_PASS = {k: v for k, v in ONE_PASS.items() if k in os.environ["ONE_PASS"].split(",")}


def bits_equal(a, b) -> bool:
    return bool(jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16) == jax.lax.bitcast_convert_type(b, jnp.uint16)))


def chunked_warpgroup(x, w):
    """The warpgroup form in 1,024-key chunks with the decode tiles it took before (mgpu_matmul.default_tiles)."""
    tiles = mgpu_module.default_tiles(x.shape[0], w.shape[1])
    cta_m = tiles["tile_m"] * (2 if tiles["split_rows"] else 1)
    cta_n = tiles["tile_n"] * (1 if tiles["split_rows"] else 2)
    steps = 6 if (cta_m + cta_n) * 64 * 2 * 6 + 2 * 2 * 64 * 64 * 2 <= mgpu_module._SMEM_BYTES else 4
    return mgpu_module._mgpu_matmul(x, w, out_dtype=x.dtype, steps=steps, cluster=None, one_pass=False,
                                    interpret=False, **tiles)


def chunked_one_row(x, w):
    """Triton's one-row form in 1,024-key chunks (before)."""
    cfg = matmul_module.default_matmul_config(x.shape[0], x.shape[1], w.shape[1])
    return matmul_module._matmul(x, w, transpose_w=False, one_pass=False, out_dtype=x.dtype, interpret=False, **cfg)


result = {"meta": run_metadata(), "one_pass_tiles": {k: list(v) for k, v in ONE_PASS.items()}, "us": {}, "bits": {}}
key = jax.random.PRNGKey(0)
for sname, ((k, n), layers) in SHAPES.items():
    ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
          for i in range(layers)]
    for m in ROWS:
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
        us = lambda fn: {s: v * 1e3 if s != "n" else v for s, v in matmul_ms(fn, x, ws).items()}  # noqa: E731
        times = {"cublas": attempt(lambda: us(lambda x, w: (x[:, None, :] @ w)[:, 0])),
                 "library": attempt(lambda: us(matmul))}
        times["chunked_before"] = attempt(lambda: us(chunked_one_row if m <= 16 else chunked_warpgroup))
        triton = jax.jit(functools.partial(matmul, block_n=128))(x, ws[0])  # launch parameters: the Triton form
        alone = jax.jit(matmul)(x[:1], ws[0])
        bits = {"library": attempt(lambda: {"rows": bits_equal(jax.jit(matmul)(x, ws[0]), triton),
                                            "row_alone": bits_equal(jax.jit(matmul)(x, ws[0])[:1], alone)})}
        if m >= 64:
            for name, (tm, tn, split_rows) in ONE_PASS.items():
                fn = functools.partial(mgpu_matmul, tile_m=tm, tile_n=tn, split_rows=split_rows)
                times[name] = attempt(lambda fn=fn: us(fn))
                bits[name] = attempt(lambda fn=fn: {"rows": bits_equal(jax.jit(fn)(x, ws[0]), triton),
                                                    "row_alone": bits_equal(jax.jit(fn)(x, ws[0])[:1], alone)})
        result["us"][f"{sname}.{m}"], result["bits"][f"{sname}.{m}"] = times, bits
        print(sname, m, {c: round(t["median"], 1) if "median" in t else t["error"][:100] for c, t in times.items()},
              bits, flush=True)
        probe_output("probe_matmul_wide_one_pass.json").write_text(json.dumps(result, indent=1))
    ws.clear()
