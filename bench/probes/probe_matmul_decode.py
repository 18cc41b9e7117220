"""Which launch parameters bring the batch-invariant matmul (pallas_kernels/matmul.py) to cuBLAS on a decode step's
projections (issue 64: the one-row matmuls are what is left of the mode's price at 8K, 3.97 ms against cuBLAS's
3.62 a step on the H200, runs/h200_invariant_price/).

For each Llama-3.1-8B projection (bf16, random weights) and row count M (1, then 16 and 64 with the default only),
one jitted program multiplies x by LAYERS (16) distinct weights given as separate arguments, as a decode step's
layers do (4 for the LM head); the program is called CALLS (10) times back to back, waited for once: ms per matmul,
median of 7 such loops with min-max. cuBLAS (XLA's dot) is timed the same way in the same run. Every config's
output is checked bit for bit against the default config's. A sweep over split_k, block_n, k_unroll and
num_stages (4 warps), then the best three of each shape with 2 and 8 warps. Writes probe_matmul_decode.json under
$OUT after each shape.

    python bench/probes/probe_matmul_decode.py
"""
import itertools
import os
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import probe_output, run_metadata, stats  # noqa: E402
from pallas_kernels.matmul import block_k_for, chunk_len_for, default_matmul_config, matmul  # noqa: E402

SHAPES = {"wqkv": (4096, 6144, False), "wo": (4096, 4096, False), "w_gate_up": (4096, 28672, False),
          "w_down": (14336, 4096, False), "lm_head": (4096, 128256, True)}
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


def sweep_configs(k: int, n: int) -> list[dict]:
    tiles = chunk_len_for(k) // block_k_for(k)
    out = []
    for split_k, block_n, (k_unroll, stages) in itertools.product(
            (True, False), (32, 64, 128, 256), ((1, 4), (1, 6), (2, 4), (2, 3), (4, 3), (4, 4))):
        if n % block_n or tiles % k_unroll or (split_k and chunk_len_for(k) == k):
            continue
        out.append(dict(block_m=16, block_n=block_n, k_unroll=k_unroll, split_k=split_k, num_warps=4,
                        num_stages=stages))
    return out


def label(c: dict) -> str:
    return f"{'split' if c['split_k'] else 'whole'}_bn{c['block_n']}_u{c['k_unroll']}_w{c['num_warps']}_s{c['num_stages']}"


result = {"meta": run_metadata(), "layers_per_program": LAYERS, "calls_per_loop": CALLS, "shapes": {}}
for name, (k, n, transposed) in SHAPES.items():
    layers = 4 if name == "lm_head" else LAYERS
    key = jax.random.PRNGKey(0)
    shape = (n, k) if transposed else (k, n)
    ws = [(jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
          for i in range(layers)]
    row = {"k": k, "n": n, "floor_bytes": 2 * k * n, "ms": {}, "bits_equal_default": {}, "default": {}}
    for m in (1, 16, 64):
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
        cub = program(lambda x, w: jnp.dot(x, w.T if transposed else w))
        default_fn = program(lambda x, w: matmul(x, w, transpose_w=transposed))
        ref = default_fn(x, ws)
        times = {"cublas": per_matmul_ms(cub, x, ws), "default": per_matmul_ms(default_fn, x, ws)}
        row["default"][m] = default_matmul_config(m, k, n)
        configs = sweep_configs(k, n) if m == 1 else []
        for c in configs:
            fn = program(lambda x, w, c=c: matmul(x, w, transpose_w=transposed, **c))
            try:
                times[label(c)] = per_matmul_ms(fn, x, ws)
                row["bits_equal_default"][f"{m}.{label(c)}"] = bool(same(jnp.stack(fn(x, ws)), jnp.stack(ref)))
            except Exception as e:  # a config Triton cannot compile (shared memory): recorded, not fatal
                times[label(c)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        if configs:
            timed = sorted((t["median"], lbl) for lbl, t in times.items() if "median" in t and lbl[:5] in
                           ("split", "whole"))
            for _, lbl in timed[:3]:
                c = next(c for c in configs if label(c) == lbl)
                for warps in (2, 8):
                    c2 = dict(c, num_warps=warps)
                    fn = program(lambda x, w, c2=c2: matmul(x, w, transpose_w=transposed, **c2))
                    try:
                        times[label(c2)] = per_matmul_ms(fn, x, ws)
                        row["bits_equal_default"][f"{m}.{label(c2)}"] = bool(same(jnp.stack(fn(x, ws)),
                                                                                  jnp.stack(ref)))
                    except Exception as e:
                        times[label(c2)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        row["ms"][m] = times
        best = min((t["median"], lbl) for lbl, t in times.items() if "median" in t)
        print(name, m, "cublas %.4f default %.4f best %s %.4f" % (times["cublas"]["median"],
                                                                    times["default"]["median"], best[1], best[0]),
              flush=True)
    row["all_bits_equal"] = all(row["bits_equal_default"].values())
    result["shapes"][name] = row
    probe_output("probe_matmul_decode.json").write_text(json.dumps(result, indent=1))
    del ws
