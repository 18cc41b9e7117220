"""Probe (issue 28): the Hopper attention kernel's consumer turns on named barriers against mbarriers, bits and speed.

`pallas_kernels/mgpu_attention.py` hands the tensor cores from one consumer warpgroup to the other through named
barriers (`bar.sync` / `bar.arrive`, as FlashAttention-3 does); the tree given by `--old` does it through shared-memory
mbarriers. Both modules are loaded side by side. (a) Bits: both kernels on the same inputs (non-causal 4K GQA; causal
8K; causal with query offsets, kv lengths and rows that see nothing; the raw state out and back in) give identical o,
lse and state. (b) Speed, B1 Hq32 Hkv8 D128 bf16, float32 O: non-causal 4K, causal 8K and 32K, TFLOP/s over
`--rounds` interleaved rounds (bench_kernels' scheme: each round one group of ~20 ms per entry, the order rotated),
cuDNN (`jax.nn.dot_product_attention`) in the same rounds.

    python bench/probes/probe_mgpu_turns.py --old OLD_TREE --out $OUT
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_kernels import attn_flops, inner_calls, interleaved_samples, jax_group, rand, tflops_spread  # noqa: E402
from common import run_metadata  # noqa: E402
from pallas_kernels import mgpu_attention as named  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--old", type=Path, required=True, help="a tree whose pallas_kernels/mgpu_attention.py uses mbarriers")
p.add_argument("--rounds", type=int, default=15)
p.add_argument("--out", type=Path, required=True)
a = p.parse_args()

spec = importlib.util.spec_from_file_location("mgpu_attention_mbarrier", a.old / "pallas_kernels/mgpu_attention.py")
mbarrier = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mbarrier)
assert not hasattr(mbarrier, "_turn") and hasattr(named, "_turn"), "the two modules are the same schedule"


def qkv(seed: int, b: int, tq: int, tk: int, hq: int = 32, hkv: int = 8, d: int = 128):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (rand(ks[0], (b, tq, hq, d), jnp.bfloat16), rand(ks[1], (b, tk, hkv, d), jnp.bfloat16),
            rand(ks[2], (b, tk, hkv, d), jnp.bfloat16))


def bits() -> list[dict]:
    q, k, v = qkv(0, 1, 4096, 4096)
    q8, k8, v8 = qkv(1, 1, 8192, 8192)
    qo, ko, vo = qkv(2, 2, 1000, 3000, hq=8, hkv=2)
    offsets, lengths = jnp.array([-200, 1500], jnp.int32), jnp.array([2900, 1700], jnp.int32)
    cases = {
        "non-causal 4K": lambda m: m.attention_with_lse_mgpu(q, k, v, causal=False),
        "causal 8K": lambda m: m.attention_with_lse_mgpu(q8, k8, v8, causal=True),
        "causal, offsets, kv lengths, empty rows": lambda m: m.attention_with_lse_mgpu(
            qo, ko, vo, causal=True, q_offset=offsets, kv_lengths=lengths),
        "state out, then in": lambda m: m.attention_with_lse_mgpu(
            qo, ko[:, 1024:], vo[:, 1024:], causal=True, q_offset=offsets - 1024, kv_lengths=lengths - 1024,
            state=m.attention_state_mgpu(qo, ko[:, :1024], vo[:, :1024], causal=True, q_offset=offsets,
                                         kv_lengths=jnp.minimum(lengths, 1024))),
    }
    rows = []
    for name, run in cases.items():
        got, want = jax.device_get(run(named)), jax.device_get(run(mbarrier))
        same = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        rows.append({"case": name, "bits_equal": bool(same)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def speed() -> list[dict]:
    rows = []
    for name, t, causal in (("non-causal 4K", 4096, False), ("causal 8K", 8192, True), ("causal 32K", 32768, True)):
        q, k, v = qkv(3, 1, t, t)
        fns = {"named barriers": jax.jit(lambda q, k, v: named.attention_with_lse_mgpu(q, k, v, causal=causal)),
               "mbarriers": jax.jit(lambda q, k, v: mbarrier.attention_with_lse_mgpu(q, k, v, causal=causal)),
               "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                             implementation="cudnn"))}
        groups = {n: jax_group(f, q, k, v, inner=inner_calls(f, q, k, v)) for n, f in fns.items()}
        samples = interleaved_samples(groups, a.rounds)
        flops = attn_flops(1, 32, t, t, 128, causal)
        row = {"shape": name, **{n: tflops_spread(flops, s) for n, s in samples.items()},
               "named_over_mbarriers_per_round": [m / n for n, m in
                                                  zip(samples["named barriers"], samples["mbarriers"])],
               "named_over_cudnn_per_round": [c / n for n, c in zip(samples["named barriers"], samples["cudnn"])]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("shape", "named barriers", "mbarriers", "cudnn")}), flush=True)
    return rows


def main() -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": run_metadata(), "rounds": a.rounds, "bits": bits()}
    (a.out / "probe_mgpu_turns.json").write_text(json.dumps(result, indent=1))
    result["speed"] = speed()
    (a.out / "probe_mgpu_turns.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
