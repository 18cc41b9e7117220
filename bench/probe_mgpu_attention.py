"""Probe: JAX's Mosaic-GPU (Hopper) flash attention vs cuDNN and our Triton kernel, causal GQA bf16."""
import dataclasses
import inspect
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from bench_kernels import attn_flops, rand, time_jax  # noqa: E402

print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
from jax.experimental.pallas.ops.gpu import attention_mgpu as am  # noqa: E402

print("TuningConfig fields:", [f.name for f in dataclasses.fields(am.TuningConfig)])
print("attention signature:", inspect.signature(am.attention))
LN2 = math.log(2.0)


def run(t, causal, configs):
    b, hq, hkv, d = 1, 32, 8, 128
    ks = jax.random.split(jax.random.key(t), 3)
    q = rand(ks[0], (b, t, hq, d), jnp.bfloat16)
    k = rand(ks[1], (b, t, hkv, d), jnp.bfloat16)
    v = rand(ks[2], (b, t, hkv, d), jnp.bfloat16)
    fl = attn_flops(b, hq, t, t, d, causal)
    cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
    ours = jax.jit(lambda q, k, v: pk.attention_with_lse(q, k, v, causal=causal))
    res = {"cudnn": fl / time_jax(cud, q, k, v) / 1e12, "triton": fl / time_jax(ours, q, k, v) / 1e12}
    o_ref, lse_ref = ours(q, k, v)
    for bq, bkv, steps in configs:
        name = f"mgpu bq{bq} bkv{bkv} s{steps}"
        try:
            cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps, causal=causal)
            def f(q, k, v, cfg=cfg):  # the JAX kernel's shared-memory tiles are float16
                o, (lse,) = am.attention(q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16), cfg, save_residuals=True)
                return o.astype(q.dtype), (lse,)
            f = jax.jit(f)
            o, (lse2,) = f(q, k, v)
            do = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32))))
            dl = float(jnp.max(jnp.abs(lse2 * LN2 - lse_ref)))
            res[name] = fl / time_jax(f, q, k, v) / 1e12
            print(f"  T{t} causal={causal} {name}: {res[name]:.1f} TFLOP/s  max|do|={do:.3g} max|dlse|={dl:.3g}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: ERROR {''.join(traceback.format_exception_only(type(e), e)).splitlines()[0][-300:]}", flush=True)
    print(f"T{t} causal={causal}: cudnn {res['cudnn']:.1f} triton {res['triton']:.1f}", flush=True)
    return res


configs = [(64, 64, 2), (64, 128, 2), (64, 128, 4), (64, 256, 2), (128, 64, 2), (128, 128, 2)]
for t, causal in [(8192, True), (32768, True), (4096, False)]:
    run(t, causal, configs)
