"""Probe: the batch-invariant matmul's one-row (decode) launch configs, with K tiles unrolled per loop step.

Batch-1 decode in batch-invariant mode reads the 8B shape's weights at 1.35x cuBLAS's time (5.61 against 4.16 ms
for the four projections of 32 layers, H200, `bench/results/runs/h200_batch_invariance/`): with one 16-row tile per
program and 32 columns, each pipeline stage holds 4 KB of weight, too little in flight to reach HBM speed.
`k_unroll` loads several 64-wide K tiles per loop step and multiplies them in the same ascending order, so the bits
should not change. For each config: the four projections of 32 layers chained (one jitted scan, as decode runs them),
at M = 1 and 8, median (min-max) of 9 calls after a warm-up, and each weight alone; cuBLAS (`x @ w`) the same way; and whether every row at
M = 1, 8, 16 has the bits of the prefill config's rows of a 256-row product, for each of the four weights.

    python bench/probes/probe_matmul_decode.py --out $OUT [--per-weight] [--only NAME,NAME]
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import call_seconds, run_metadata, stats  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402

LAYERS = 32
SHAPES = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672), "w_down": (14336, 4096)}
# (block_m, block_n, k_unroll, num_warps, num_stages)
CONFIGS = {"bn32_u1_s6 (before)": (16, 32, 1, 4, 6), "bn32_u1_s8": (16, 32, 1, 4, 8),
           "bn32_u2_s4": (16, 32, 2, 4, 4), "bn32_u2_s6": (16, 32, 2, 4, 6), "bn32_u4_s3": (16, 32, 4, 4, 3),
           "bn32_u4_s4": (16, 32, 4, 4, 4), "bn64_u2_s4": (16, 64, 2, 4, 4), "bn64_u4_s3": (16, 64, 4, 4, 3),
           "bn16_u4_s4": (16, 16, 4, 4, 4), "bn16_u2_s6": (16, 16, 2, 4, 6), "bn64_u2_w8_s4": (16, 64, 2, 8, 4),
           "bn32_u8_s2": (16, 32, 8, 4, 2), "bn64_u4_s4": (16, 64, 4, 4, 4), "bn64_u8_s2": (16, 64, 8, 4, 2),
           "bn128_u2_s4": (16, 128, 2, 4, 4), "bn128_u4_s2": (16, 128, 4, 4, 2), "bn32_u2_s8": (16, 32, 2, 4, 8),
           "bn32_u4_s6": (16, 32, 4, 4, 6), "bn16_u8_s4": (16, 16, 8, 4, 4), "bn128_u1_s6": (16, 128, 1, 4, 6),
           "bn128_u2_s3": (16, 128, 2, 4, 3), "bn64_u1_s8": (16, 64, 1, 4, 8)}
REFERENCE = (128, 128, 1, 8, 3)

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--only", default="", help="comma-separated config names (default: all)")
p.add_argument("--per-weight", action="store_true", help="also time each weight alone")
a = p.parse_args()
# "default": default_matmul_config's choice for each weight.
configs = {k: v for k, v in (CONFIGS | {"default": "default"}).items() if not a.only or k in a.only.split(",")}


def mm_for(cfg):
    if cfg is None:
        return lambda x, w: x @ w
    if cfg == "default":
        return matmul
    bm, bn, u, nw, ns = cfg
    return lambda x, w: matmul(x, w, block_m=bm, block_n=bn, k_unroll=u, num_warps=nw, num_stages=ns)


def chain_for(mm):
    """The four projections of every layer, each feeding the next, as one decode step runs them (layers unrolled:
    a scan over stacked weights would copy each layer's slice out before the call)."""
    def step(x, layers):
        for ws in layers:
            qkv = mm(x, ws["wqkv"])
            o = mm(qkv[:, :4096], ws["wo"])
            gu = mm(o, ws["w_gate_up"])
            x = mm(gu[:, :14336], ws["w_down"])
        return x
    return jax.jit(step)


key = jax.random.PRNGKey(0)
layers = [{name: (jax.random.normal(jax.random.fold_in(key, 100 * i + j), (k, n), jnp.float32)
                  * (1 / k ** 0.5)).astype(jnp.bfloat16) for j, (name, (k, n)) in enumerate(SHAPES.items())}
          for i in range(LAYERS)]
jax.block_until_ready(layers)
bytes_read = sum(k * n * 2 for k, n in SHAPES.values()) * LAYERS
out = {"meta": run_metadata(), "layers": LAYERS, "weight_GB": bytes_read / 1e9, "configs": {}, "ms": {}, "bits": {}}

same = jax.jit(lambda a_, b_: jnp.all(jax.lax.bitcast_convert_type(a_, jnp.uint16)
                                      == jax.lax.bitcast_convert_type(b_, jnp.uint16)))
xs = {name: jax.random.normal(jax.random.PRNGKey(10 + i), (256, k), jnp.bfloat16)
      for i, (name, (k, n)) in enumerate(SHAPES.items())}
refs = {name: jax.jit(mm_for(REFERENCE))(xs[name], layers[0][name]) for name in SHAPES}

for m in (1, 8):
    x = jax.random.normal(jax.random.PRNGKey(99), (m, 4096), jnp.bfloat16)
    out["ms"][m] = {}
    for name, cfg in [("cublas", None)] + list(configs.items()):
        f = chain_for(mm_for(cfg))
        t = stats([s * 1e3 for s in call_seconds(lambda: f(x, layers), 9)])
        out["ms"][m][name] = t
        print(f"M={m} {name:22s} {t['median']:.3f} ms ({t['min']:.3f}-{t['max']:.3f}), "
              f"{bytes_read / t['median'] / 1e6:.0f} GB/s", flush=True)

# Each weight alone: its 32 layers' products of one x, one kernel after another.
out["ms_per_weight"] = {}
for w in SHAPES if a.per_weight else ():
    for m in (1, 8):
        x = jax.random.normal(jax.random.PRNGKey(98), (m, SHAPES[w][0]), jnp.bfloat16)
        row = out["ms_per_weight"].setdefault(w, {}).setdefault(m, {})
        for name, cfg in [("cublas", None)] + list(configs.items()):
            f = jax.jit(lambda x_, ws, mm=mm_for(cfg): [mm(x_, l_[w]) for l_ in ws])
            row[name] = stats([s_ * 1e3 for s_ in call_seconds(lambda: f(x, layers), 9)])
        best = sorted(row, key=lambda n_: row[n_]["median"])[:4]
        print(f"{w} M={m}: " + ", ".join(f"{n_} {row[n_]['median']:.3f}" for n_ in best)
              + f"; before {row['bn32_u1_s6 (before)']['median']:.3f}", flush=True)

for name, cfg in configs.items():
    out["configs"][name] = (dict(zip(("block_m", "block_n", "k_unroll", "num_warps", "num_stages"), cfg))
                            if cfg != "default" else "default_matmul_config")
    f = jax.jit(mm_for(cfg))
    ok = {f"{w}@M={m}": bool(same(f(xs[w][:m], layers[0][w]), refs[w][:m]))
          for w in SHAPES for m in (1, 8, 16)}
    out["bits"][name] = {"all_equal_reference": all(ok.values()), "cases": ok}
    print(f"bits {name:22s} {'all equal' if all(ok.values()) else 'DIFFER: ' + str(ok)}", flush=True)

a.out.mkdir(parents=True, exist_ok=True)
(a.out / "probe_matmul_decode.json").write_text(json.dumps(out, indent=1))
