"""Which launch parameters bring the batch-invariant matmul (pallas_kernels/matmul.py) to cuBLAS on the Llama-3.1-8B
projections, by row count (issue 64: the one-row matmuls were what was left of the mode's batch-1 price, a batched
decode step's 64 rows ran w_down at 2x cuBLAS's time, and the 32K prefill took 2.10x the default's,
runs/h200_matmul_decode/ and runs/h200_invariant_price/).

For each projection (bf16, random weights) and row count M in ROWS (default 1, 16, 64), one jitted program
multiplies x by LAYERS (16; 4 for the LM head and for M > 512) distinct weights given as separate arguments, as a
step's layers do; the program is called CALLS (10) times back to back, waited for once: ms per matmul, median of 7
such loops with min-max. cuBLAS (XLA's dot) and the default config are timed the same way in the same run. At each M
in SWEEP (default 1) a sweep of launch parameters (at one to sixteen rows, then the best three with 2 and 8 warps);
every config's output is checked bit for bit against the default config's. The LM head is skipped past 512 rows (a
prefill takes logits of its last rows only). Writes probe_matmul_decode.json under $OUT after each shape.

    python bench/probes/probe_matmul_decode.py
    ROWS=64,256,8192 SWEEP=64,256,8192 python bench/probes/probe_matmul_decode.py
"""
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ["JAX_OFFLOAD_HOPPER_MATMUL"] = "0"  # the Triton form's tiles: its default too, not the warpgroup form

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import probe_output, run_metadata, stats  # noqa: E402
from pallas_kernels.matmul import block_k_for, chunk_len_for, default_matmul_config, matmul  # noqa: E402

SHAPES = {"wqkv": (4096, 6144, False), "wo": (4096, 4096, False), "w_gate_up": (4096, 28672, False),
          "w_down": (14336, 4096, False), "lm_head": (4096, 128256, True)}
ROWS = [int(m) for m in os.environ.get("ROWS", "1,16,64").split(",")]
SWEEP = {int(m) for m in os.environ.get("SWEEP", "1").split(",")}
LAYERS, CALLS, LOOPS = int(os.environ.get("LAYERS", 16)), 10, 7


def per_matmul_ms(fn, x, ws) -> dict:
    jax.block_until_ready(fn(x, ws))
    samples = []
    for _ in range(LOOPS):
        t = time.perf_counter()
        outs = [fn(x, ws) for _ in range(CALLS)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t) * 1e3 / (CALLS * len(ws)))
    return stats(samples)


def program(mm):
    return jax.jit(lambda x, ws: [mm(x, w) for w in ws])


same = jax.jit(lambda a, b: jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16)
                                    == jax.lax.bitcast_convert_type(b, jnp.uint16)))


def sweep_configs(m: int, k: int, n: int) -> list[dict]:
    """Launch parameters to try at M rows: one row tile at decode sizes, up to 64-row tiles for a batched decode
    step, 64- and 128-row tiles for prefill."""
    tiles = chunk_len_for(k) // block_k_for(k)
    if m <= 16:
        grid = itertools.product((16,), (True, False), (32, 64, 128, 256),
                                 ((1, 4, 4), (1, 4, 6), (2, 4, 4), (2, 4, 3), (4, 4, 3), (4, 4, 4)))
    elif m <= 512:
        grid = itertools.product((16, 32, 64), (True, False), (64, 128), ((1, 4, 4), (2, 4, 3), (1, 8, 3)))
    else:
        grid = itertools.product((64, 128), (False,), (128, 256), ((1, 4, 3), (1, 8, 3), (1, 8, 4)))
    out = []
    for block_m, split_k, block_n, (k_unroll, warps, stages) in grid:
        if n % block_n or tiles % k_unroll or (split_k and chunk_len_for(k) == k):
            continue
        out.append(dict(block_m=block_m, block_n=block_n, k_unroll=k_unroll, split_k=split_k, num_warps=warps,
                        num_stages=stages))
    return out


def label(c: dict) -> str:
    return (f"{'split' if c['split_k'] else 'whole'}_bm{c['block_m']}_bn{c['block_n']}_u{c['k_unroll']}"
            f"_w{c['num_warps']}_s{c['num_stages']}")


def time_config(times: dict, bits: dict, m: int, c: dict, x, ws, ref, transposed: bool) -> None:
    """Times matmul with launch parameters `c` into times[label], its bits against `ref` into bits."""
    fn = program(lambda x, w: matmul(x, w, transpose_w=transposed, **c))
    try:
        times[label(c)] = per_matmul_ms(fn, x, ws)
        bits[f"{m}.{label(c)}"] = bool(same(jnp.stack(fn(x, ws)), jnp.stack(ref)))
    except Exception as e:  # a config Triton cannot compile (shared memory): recorded, not fatal
        times[label(c)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}


result = {"meta": run_metadata(), "layers_per_program": LAYERS, "calls_per_loop": CALLS, "shapes": {}}
for name, (k, n, transposed) in SHAPES.items():
    rows = [m for m in ROWS if m <= 512 or name != "lm_head"]
    if not rows:
        continue
    key = jax.random.PRNGKey(0)
    shape = (n, k) if transposed else (k, n)
    all_ws = [(jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
              for i in range(4 if name == "lm_head" else LAYERS)]
    row = {"k": k, "n": n, "floor_bytes": 2 * k * n, "ms": {}, "bits_equal_default": {}, "default": {}}
    for m in rows:
        ws = all_ws[:4] if m > 512 else all_ws
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
        cub = program(lambda x, w: jnp.dot(x, w.T if transposed else w))
        default = program(lambda x, w: matmul(x, w, transpose_w=transposed))
        ref = default(x, ws)
        times = {"cublas": per_matmul_ms(cub, x, ws), "default": per_matmul_ms(default, x, ws)}
        row["default"][m] = default_matmul_config(m, k, n)
        configs = sweep_configs(m, k, n) if m in SWEEP else []
        for c in configs:
            time_config(times, row["bits_equal_default"], m, c, x, ws, ref, transposed)
        if configs and m <= 16:
            timed = sorted((t["median"], lbl) for lbl, t in times.items() if "median" in t and lbl[:5] in
                           ("split", "whole"))
            for _, lbl in timed[:3]:
                c = next(c for c in configs if label(c) == lbl)
                for warps in (2, 8):
                    time_config(times, row["bits_equal_default"], m, dict(c, num_warps=warps), x, ws, ref,
                                transposed)
        row["ms"][m] = times
        best = min((t["median"], lbl) for lbl, t in times.items() if "median" in t)
        print(name, m, "cublas %.4f default %.4f best %s %.4f" % (times["cublas"]["median"],
                                                                    times["default"]["median"], best[1], best[0]),
              flush=True)
    row["all_bits_equal"] = all(row["bits_equal_default"].values())
    result["shapes"][name] = row
    probe_output("probe_matmul_decode.json").write_text(json.dumps(result, indent=1))
    del all_ws
