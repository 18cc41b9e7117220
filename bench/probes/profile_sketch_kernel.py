"""One launch of the Hopper sketch kernel at 256K tokens (Llama-3.1-8B shape, page 16, int4 words) for a profiler:
    ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --set full python bench/probes/profile_sketch_kernel.py"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels  # noqa: E402

HKV, G, D, PAGE, TOKENS = 8, 4, 128, 16, 262144
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
codes = jax.random.bits(k1, (HKV, PAGE, TOKENS // PAGE, D // 8), jnp.uint32)
scales = jax.random.uniform(k2, (HKV, PAGE, TOKENS // PAGE), jnp.float32, 0.01, 0.05)
q = jax.random.normal(k3, (HKV, G, D), jnp.bfloat16)
score = jax.jit(lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4))
for _ in range(4):
    score(q, codes, scales).block_until_ready()
