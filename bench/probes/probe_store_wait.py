"""Probe: does a Hopper kernel's last wait cost time? Both Mosaic GPU kernels end with `plgpu.wait_smem_to_gmem(0)`
(the CTA stays until its output copies have reached global memory); `wait_read_only=True` waits only until the
copies have read shared memory (what CUTLASS's epilogues do before a CTA exits; the writes still land before the
kernel ends). A CTA per tile pays that wait in every tile's life, so the short-lived CTAs feel it most: attention at
4K without a mask (issue 28's one open target) and the sketch scoring kernel (a CTA reads 64 KiB and leaves).

Each variant is compiled apart (the kernels' modules see a copy of `plgpu` whose `wait_smem_to_gmem` passes
`wait_read_only=True`, and their jitted launches are re-made so no trace is shared), both are checked for equal
outputs (bit for bit), and timed in 3 alternated rounds:
- attention, B1 Hq32 Hkv8 D128 bf16, non-causal 4K, causal 8K, causal 32K, against cuDNN
  (jax.nn.dot_product_attention) in the same rounds; each round the median of 10 groups of ~20 ms of queued calls
  (bench_kernels.time_jax_samples), TFLOP/s;
- sketch scoring, Llama-3.1-8B shape, 30 layers, int4, 128K and 256K: GPU ms per pass over the 30 layers as
  probe_sketch_mgpu.py measures it ((t4 - t1) / 3 of programs running the 30 layers 1 and 4 times, medians of 20
  waited calls).

    python bench/probes/probe_store_wait.py --out DIR     # on the GPU: DIR/probe_store_wait.json
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

import pallas_kernels  # noqa: E402
from bench_kernels import attn_flops, rand, time_jax_samples  # noqa: E402
from common import call_seconds, run_metadata  # noqa: E402
from pallas_kernels import mgpu_attention, mgpu_sketch  # noqa: E402

ROUNDS = 3
SHAPES = (("non-causal 4K", 4096, False), ("causal 8K", 8192, True), ("causal 32K", 32768, True))
HKV, G, D, PAGE, LAYERS, REPEATS = 8, 4, 128, 16, 30, 4
ORIGINAL = {mgpu_attention: ("_attention_mgpu", mgpu_attention._attention_mgpu),
            mgpu_sketch: ("_launch", mgpu_sketch._launch)}


def use_variant(read_only: bool) -> None:
    """Point both kernel modules at a plgpu whose last wait is read-only (or the real one), with fresh launches."""
    module = types.ModuleType("plgpu_variant")
    module.__dict__.update(plgpu.__dict__)
    if read_only:
        module.wait_smem_to_gmem = functools.partial(plgpu.wait_smem_to_gmem, wait_read_only=True)
    for mod, (name, jitted) in ORIGINAL.items():
        mod.plgpu = module
        wrapped = jitted.__wrapped__
        statics = tuple(n for n in ("finish", "causal", "sm_scale", "out_dtype", "block_q", "block_kv",
                                    "max_concurrent_steps", "semantics", "interpret", "num_pages")
                        if n in wrapped.__code__.co_varnames)
        setattr(mod, name, jax.jit(lambda *a, _w=wrapped, **k: _w(*a, **k), static_argnames=statics))


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def attention_rows(variants: dict) -> dict:
    out = {}
    for label, t, causal in SHAPES:
        ks = jax.random.split(jax.random.key(1), 3)
        q, k, v = (rand(ks[0], (1, t, 32, D), jnp.bfloat16), rand(ks[1], (1, t, HKV, D), jnp.bfloat16),
                   rand(ks[2], (1, t, HKV, D), jnp.bfloat16))
        flops = attn_flops(1, 32, t, t, D, causal)
        fns = {"cudnn": compiled(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)}
        for name, read_only in variants.items():
            use_variant(read_only)
            fns[name] = compiled(lambda q, k, v: pallas_kernels.attention_with_lse(q, k, v, causal=causal), q, k, v)
        outs = {name: fns[name](q, k, v) for name in variants}
        first, *rest = outs.values()
        same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for o in rest for a, b in zip(first, o))
        rounds = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                rounds[name].append(flops / float(np.median(time_jax_samples(fn, q, k, v))) / 1e12)
        out[label] = {"tflops_per_round": rounds, "outputs_bit_equal": same}
        print(label, json.dumps(out[label]), flush=True)
    return out


def _read(c, s, salt):  # probe_sketch_mgpu.py's floor: every byte summed, chained pass to pass
    words = jax.lax.bitcast_convert_type(c.reshape(*c.shape[:-1], D // 8, 4), jnp.uint32)
    return jnp.sum(words ^ salt) + jnp.sum(jax.lax.bitcast_convert_type(s, jnp.uint32) ^ salt)


def sketch_rows(variants: dict) -> dict:
    out = {}
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in (131072, 262144):
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        runs = {}
        for name, read_only in variants.items():
            use_variant(read_only)
            for r in (1, REPEATS):
                runs[name, r] = compiled(lambda q, c, s, r=r: [
                    pallas_kernels.sketch_page_lse(q[i] + jnp.bfloat16(j), c[i], s[i], bits=4)
                    for j in range(r) for i in range(LAYERS)], q, codes, scales)

        def chained_reads(q, c, s, r):
            sums = [jnp.uint32(0)]
            for _ in range(r):
                for i in range(LAYERS):
                    sums.append(_read(c[i], s[i], sums[-1]))
            return sums[1:]

        for r in (1, REPEATS):
            runs["xla_read", r] = compiled(functools.partial(chained_reads, r=r), q, codes, scales)
        firsts = [runs[name, 1](q, codes, scales) for name in variants]
        same = all(bool(jnp.array_equal(a, b)) for o in firsts[1:] for a, b in zip(firsts[0], o))
        per_pass = {name: [] for name in (*variants, "xla_read")}
        for _ in range(ROUNDS):
            for name in per_pass:
                t1, t4 = (float(np.median(call_seconds(lambda r=r: runs[name, r](q, codes, scales), 20)))
                          for r in (1, REPEATS))
                per_pass[name].append((t4 - t1) / (REPEATS - 1) * 1e3)
        out[str(tokens)] = {"gpu_ms_per_pass_of_30_layers_per_round": per_pass, "outputs_bit_equal": same}
        print(tokens, json.dumps(out[str(tokens)]), flush=True)
        del codes, scales, runs
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="attention,sketch")
    args = ap.parse_args()
    variants = {"wait_for_writes": False, "wait_for_reads": True}
    result = {**run_metadata(), "variants": "the CTA's last wait_smem_to_gmem(0): for the writes (today) or the "
              "reads only (wait_read_only=True)", "rounds": ROUNDS}
    path = Path(args.out, "probe_store_wait.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    if "attention" in parts:
        result["attention_tflops"] = attention_rows(variants)
        path.write_text(json.dumps(result, indent=1) + "\n")
    if "sketch" in parts:
        result["sketch"] = sketch_rows(variants)
        path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
