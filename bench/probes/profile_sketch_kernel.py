"""One launch of the Hopper sketch kernel at 256K tokens (Llama-3.1-8B shape, page 16, int4) for a profiler; argument
`v1` profiles bench/probes/mgpu_sketch_v1.py's kernel instead of the engine's:
    ncu --launch-skip 2 --launch-count 1 --set full python bench/probes/profile_sketch_kernel.py [v1]"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "probes")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels  # noqa: E402

HKV, G, D, PAGE, TOKENS = 8, 4, 128, 16, 262144
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
codes = jax.random.bits(k1, (HKV, PAGE, TOKENS // PAGE, D // 2), jnp.uint8)
scales = jax.random.uniform(k2, (HKV, PAGE, TOKENS // PAGE), jnp.float32, 0.01, 0.05)
q = jax.random.normal(k3, (HKV, G, D), jnp.bfloat16)
if sys.argv[1:] == ["v1"]:
    import mgpu_sketch_v1
    score = jax.jit(lambda q, c, s: mgpu_sketch_v1.sketch_page_lse_mgpu(q, c, s))
else:
    score = jax.jit(lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4))
for _ in range(4):
    score(q, codes, scales).block_until_ready()
