"""Non-causal 4K GQA attention (B1 T4096 Hq32 Hkv8 D128 bf16), ours or cuDNN's, run 4 times for a profiler:
    ncu --kernel-name regex:... --launch-skip 2 --launch-count 1 --set full python bench/probes/profile_attention_4k.py ours|cudnn"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402

ks = jax.random.split(jax.random.key(1), 3)
q = jax.random.normal(ks[0], (1, 4096, 32, 128), jnp.bfloat16)
k = jax.random.normal(ks[1], (1, 4096, 8, 128), jnp.bfloat16)
v = jax.random.normal(ks[2], (1, 4096, 8, 128), jnp.bfloat16)
if sys.argv[1] == "ours":
    fn = jax.jit(lambda q, k, v: pk.attention_with_lse(q, k, v, causal=False))
else:
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=False, implementation="cudnn"))
for _ in range(4):
    jax.block_until_ready(fn(q, k, v))
