"""Probe: the batch-invariant matmul's launch configs at decode row counts, timed as decode runs them: the four
projections of all 32 layers of the Llama-3.1-8B shape (random bf16) chained in one jitted call, M = 1 and 8 rows,
against XLA's dot (cuBLAS) and the HBM floor (the weights read once at the device's measured read rate). Median of
7 calls after a warm-up, with min and max.
  PYTHONPATH=. python bench/probes/probe_matmul_decode.py   (JSON to $PROBE_OUT, or printed)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import call_seconds, run_metadata, stats  # noqa: E402
from pallas_kernels.matmul import matmul  # noqa: E402

H, I, QKV, L = 4096, 14336, 6144, 32
CONFIGS = {"bm16_bn16_w4_s4": (16, 16, 4, 4), "bm16_bn32_w4_s4": (16, 32, 4, 4), "bm16_bn64_w4_s4": (16, 64, 4, 4),
           "bm16_bn16_w2_s4": (16, 16, 2, 4), "bm16_bn32_w4_s6": (16, 32, 4, 6), "bm16_bn128_w4_s4": (16, 128, 4, 4)}
key = jax.random.PRNGKey(0)
layers = []
for i in range(L):
    ks = jax.random.split(jax.random.fold_in(key, i), 4)
    layers.append(tuple((jax.random.normal(k, s, jnp.bfloat16) * 0.02) for k, s in
                        zip(ks, [(H, QKV), (H, H), (H, 2 * I), (I, H)])))
jax.block_until_ready(layers)


def chain(mm):
    def run(x, layers):
        for wqkv, wo, wgu, wd in layers:
            a = mm(x, wqkv)[:, :H]
            x = mm(a, wo)
            g = mm(x, wgu)
            x = mm(g[:, :I] * g[:, I:], wd)
        return x
    return jax.jit(run)


x_big = jnp.ones((1 << 30) // 2, jnp.bfloat16)
read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
rate = stats([(1 << 30) / s for s in call_seconds(lambda: read(x_big), 9)])["median"]
del x_big
weight_bytes = L * 2 * (H * QKV + H * H + H * 2 * I + I * H)
out = {"meta": run_metadata(), "read_bytes_per_s": rate, "floor_ms": weight_bytes / rate * 1e3, "ms": {}}
fns = {"cublas": chain(lambda x, w: x @ w)} | {
    name: chain(lambda x, w, c=c: matmul(x, w, block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3]))
    for name, c in CONFIGS.items()}
for m in (1, 8):
    x = jax.random.normal(jax.random.PRNGKey(1), (m, H), jnp.bfloat16) * 0.1
    out["ms"][m] = {name: stats([s * 1e3 for s in call_seconds(lambda: f(x, layers), 7)]) for name, f in fns.items()}
    print(m, {k: round(v["median"], 3) for k, v in out["ms"][m].items()}, "floor", round(out["floor_ms"], 3),
          flush=True)
text = json.dumps(out, indent=1)
if os.environ.get("PROBE_OUT"):
    open(os.environ["PROBE_OUT"], "w").write(text)
