"""Do the batch-invariant matmul's decode orders reach cuBLAS on the 8B's 64-256-row decode batches (issue 64)? A
256-row step's w_gate_up took 115 us in 1,024-key chunks against cuBLAS's 94, its LM head 506 against 436, its
w_down 66.6 against 51.4, and w_down at 128 rows 61.5 against 41.7 (runs/h200_invariant_price/, 60th session).

Two orders are probed, each against the one before it:
- wide weights (matmul.ONE_PASS_N columns: w_gate_up, the LM head) sum K in one pass for every token: a consumer
  warpgroup holds one float32 tile instead of two, so CTAs of 128 x 256 fit ("chunked_before": the chunks with the
  decode tiles they took; at one row Triton's one-row form);
- a deep K's chunks in two groups (matmul.k_groups_for: w_down's 14 chunks), a CTA a group, the groups' float32 sums
  added after: twice the CTAs over a narrow weight ("one_group_before": K's chunks in one run, its old tiles).

For each weight at ROWS: us per matmul (distinct weights a program, `common.matmul_ms`) of cuBLAS (the engine's
[B, 1, K] rows), the order before, the library now (`matmul`) and the warpgroup form at several CTA shapes. Bits: each
output against the Triton form over the same rows (launch parameters given: the Triton form), and its first row
against that row multiplied alone.

    python bench/probes/probe_matmul_orders.py     # writes probe_matmul_orders.json under $OUT
    SHAPES=w_down ROWS=128,256 python bench/probes/probe_matmul_orders.py

Named probe_matmul_wide_one_pass.py, without w_down, at fecff2a (its file: price_2026_12_01/wide_one_pass/).
"""
import functools
import json
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import attempt, matmul_ms, probe_output, run_metadata  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402
from pallas_kernels.mgpu_matmul import mgpu_matmul  # noqa: E402

matmul_module, mgpu_module = sys.modules["pallas_kernels.matmul"], sys.modules["pallas_kernels.mgpu_matmul"]

# (K, N), distinct weights a program
SHAPES = {"w_gate_up": ((4096, 28672), 16), "lm_head": ((4096, 128256), 6), "w_down": ((14336, 4096), 16)}
if os.environ.get("SHAPES"):
    SHAPES = {k: v for k, v in SHAPES.items() if k in os.environ["SHAPES"].split(",")}
ROWS = [int(m) for m in os.environ.get("ROWS", "1,64,128,256").split(",")]
TILES = {  # mgpu_matmul tiles: (tile_m, tile_n of each consumer warpgroup, split_rows) -> a CTA's rows x columns
    "rows_64x128": (64, 128, True),     # 128 x 128
    "cols_64x64": (64, 64, False),      # 64 x 128
    "cols_64x128": (64, 128, False),    # 64 x 256
    "rows_64x256": (64, 256, True),     # 128 x 256
    "cols_128x128": (128, 128, False),  # 128 x 256
    "rows_128x128": (128, 128, True),   # 256 x 128
}
# A consumer holds two float32 tiles in chunks: 128 x 128 at most (256 registers a thread past that).
CHUNKED_TILES = ("rows_64x128", "cols_64x64")


def bits_equal(a, b) -> bool:
    return bool(jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16) == jax.lax.bitcast_convert_type(b, jnp.uint16)))


def chunked_before(x, w):
    """Wide weights before: the warpgroup form in 1,024-key chunks with the decode tiles it took then; Triton's
    one-row form at one row."""
    if x.shape[0] <= 16:
        cfg = matmul_module.default_matmul_config(x.shape[0], x.shape[1], w.shape[1])
        return matmul_module._matmul(x, w, transpose_w=False, one_pass=False, out_dtype=x.dtype, interpret=False,
                                     **cfg)
    tiles = mgpu_module.default_tiles(x.shape[0], w.shape[1])
    steps = mgpu_module.ring_slots(dtype=x.dtype, store_dtype=x.dtype, **tiles)
    return mgpu_module._mgpu_matmul(x, w, out_dtype=x.dtype, steps=steps, cluster=None,
                                    one_pass=False, interpret=False, **tiles)


def one_group_before(x, w):
    """Deep weights before: K's chunks in one run, with the form and tiles the library took then, traced from the
    unjitted kernels' wrappers with k_groups_for patched to 1 (a jitted wrapper could answer from its cache)."""
    m, k = x.shape
    one = lambda k, one_pass=False: 1  # noqa: E731
    with mock.patch.object(matmul_module, "k_groups_for", one), mock.patch.object(mgpu_module, "k_groups_for", one):
        if matmul_module.wgmma_suits(m, w.shape[1], k):
            tiles = mgpu_module.default_tiles(m, w.shape[1])
            steps = mgpu_module.ring_slots(dtype=x.dtype, store_dtype=x.dtype, **tiles)
            return mgpu_module._mgpu_matmul.__wrapped__(x, w, out_dtype=x.dtype, steps=steps,
                                                        cluster=None, one_pass=False, interpret=False, **tiles)
        cfg = matmul_module.default_matmul_config(m, k, w.shape[1])
        return matmul_module._matmul.jitted[1].__wrapped__(x, w, transpose_w=False, one_pass=False,
                                                           out_dtype=x.dtype, interpret=False, **cfg)


result = {"meta": run_metadata(), "tiles": {k: list(v) for k, v in TILES.items()}, "us": {}, "bits": {}}
key = jax.random.PRNGKey(0)
for sname, ((k, n), layers) in SHAPES.items():
    wide = n >= matmul_module.ONE_PASS_N
    ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
          for i in range(layers)]
    for m in ROWS:
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
        us = lambda fn: {s: v * 1e3 if s != "n" else v for s, v in matmul_ms(fn, x, ws).items()}  # noqa: E731
        before = "chunked_before" if wide else "one_group_before"
        times = {"cublas": attempt(lambda: us(lambda x, w: (x[:, None, :] @ w)[:, 0])),
                 "library": attempt(lambda: us(matmul)),
                 before: attempt(lambda: us(chunked_before if wide else one_group_before))}
        triton = jax.jit(functools.partial(matmul, block_n=128))(x, ws[0])  # launch parameters: the Triton form
        alone = jax.jit(matmul)(x[:1], ws[0])
        bits = {"library": attempt(lambda: {"rows": bits_equal(jax.jit(matmul)(x, ws[0]), triton),
                                            "row_alone": bits_equal(jax.jit(matmul)(x, ws[0])[:1], alone)})}
        if m >= 64:
            for name, (tm, tn, split_rows) in TILES.items():
                if not wide and name not in CHUNKED_TILES:
                    continue
                fn = functools.partial(mgpu_matmul, tile_m=tm, tile_n=tn, split_rows=split_rows)
                times[name] = attempt(lambda fn=fn: us(fn))
                bits[name] = attempt(lambda fn=fn: {"rows": bits_equal(jax.jit(fn)(x, ws[0]), triton),
                                                    "row_alone": bits_equal(jax.jit(fn)(x, ws[0])[:1], alone)})
        result["us"][f"{sname}.{m}"], result["bits"][f"{sname}.{m}"] = times, bits
        print(sname, m, {c: round(t["median"], 1) if "median" in t else t["error"][:100] for c, t in times.items()},
              bits, flush=True)
        probe_output("probe_matmul_orders.json").write_text(json.dumps(result, indent=1))
    ws.clear()
