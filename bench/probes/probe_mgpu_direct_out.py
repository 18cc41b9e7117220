"""Probe (issue 28, non-causal 4K): the Hopper kernel's O stored from registers straight to global memory
(`mgpu_attention.DIRECT_OUT`) against staging it through shared memory and a TMA copy (the shipped epilogue),
with 2 and 3 K/V ring slots. Bits compared with the shipped kernel (o, lse; the state path), then TFLOP/s in
alternated rounds with cuDNN, each round the median of 10 groups (probe_mgpu_kernel.time_stats).

    python bench/probes/probe_mgpu_direct_out.py --out DIR   # -> DIR/probe_mgpu_direct_out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_mgpu_kernel as pmk  # noqa: E402  (sets the memory fraction, paths)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import mgpu_attention as mga  # noqa: E402
from bench_kernels import attn_flops, rand  # noqa: E402
from common import run_metadata  # noqa: E402

VARIANTS = [("smem O, 2 slots (shipped)", False, 2), ("direct O, 2 slots", True, 2), ("direct O, 3 slots", True, 3)]
SHAPES = [("non-causal 4K", 4096, False), ("causal 8K", 8192, True), ("causal 32K", 32768, True)]


def build(direct: bool, steps: int, fn):
    """A jitted call traced with DIRECT_OUT = direct (the flag is read while tracing)."""
    f = jax.jit(fn(steps))
    mga.DIRECT_OUT = direct
    return f


def traced(f, *args):
    out = f(*args)
    jax.block_until_ready(out)
    mga.DIRECT_OUT = False
    return out


def bits(result: dict) -> None:
    rng = np.random.default_rng(28)
    cases = []
    for name, tq, tk, causal, kw in [
        ("non-causal 4K", 4096, 4096, False, {}),
        ("causal offsets, kv lengths, empty rows", 1000, 1500, True,
         dict(q_offset=jnp.asarray(-40, jnp.int32), kv_lengths=jnp.asarray(1300, jnp.int32))),
        ("causal, bf16 out", 2048, 2048, True, dict(out_dtype=jnp.bfloat16)),
        ("state out (attention_state_mgpu)", 2048, 4096, True, dict(state_out=True)),
    ]:
        q = jnp.asarray(rng.standard_normal((1, tq, 32, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((1, tk, 8, 128)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((1, tk, 8, 128)), jnp.bfloat16)
        cases.append((name, causal, kw, q, k, v))
    rows = []
    for name, causal, kw, q, k, v in cases:
        kw = dict(kw)
        state_out = kw.pop("state_out", False)

        def fn(steps, causal=causal, kw=kw, state_out=state_out):
            if state_out:
                return lambda q, k, v: tuple(mga.attention_state_mgpu(q, k, v, causal=causal,
                                                                      max_concurrent_steps=steps, **kw))
            return lambda q, k, v: mga.attention_with_lse_mgpu(q, k, v, causal=causal,
                                                               max_concurrent_steps=steps, **kw)
        outs = {}
        for label, direct, steps in VARIANTS:
            try:
                outs[label] = [np.asarray(x.astype(jnp.float32)) for x in traced(build(direct, steps, fn), q, k, v)]
            except Exception as e:  # noqa: BLE001
                outs[label] = pmk.first_line(e)
        base = outs[VARIANTS[0][0]]
        for label, *_ in VARIANTS[1:]:
            got = outs[label]
            row = {"case": name, "variant": label}
            if isinstance(got, str) or isinstance(base, str):
                row.update(error=got if isinstance(got, str) else base, pass_=False)
            else:
                row["identical"] = [bool(np.array_equal(a, b, equal_nan=True)) for a, b in zip(got, base)]
                row["pass_"] = all(row["identical"])
            rows.append(row)
            print(f"{'PASS' if row['pass_'] else 'FAIL'} bits {name:40s} {label}: {row.get('identical', row.get('error'))}",
                  flush=True)
    result["bits"] = rows


def timing(result: dict, rounds: int) -> None:
    for label, t, causal in SHAPES:
        ks = jax.random.split(jax.random.key(t), 3)
        q = rand(ks[0], (1, t, 32, 128), jnp.bfloat16)
        k = rand(ks[1], (1, t, 8, 128), jnp.bfloat16)
        v = rand(ks[2], (1, t, 8, 128), jnp.bfloat16)
        flops = attn_flops(1, 32, t, t, 128, causal)
        fns = {"cudnn": jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="cudnn"))}
        for name, direct, steps in VARIANTS:
            f = build(direct, steps, lambda s, c=causal: lambda q, k, v: mga.attention_with_lse_mgpu(
                q, k, v, causal=c, q_offset=0, max_concurrent_steps=s))
            traced(f, q, k, v)
            fns[name] = f
        per = {name: [] for name in fns}
        for r in range(rounds):
            for name, f in fns.items():
                per[name].append(pmk.tflops(flops, pmk.time_stats(f, q, k, v, reps=10))["tflops"])
            print(f"  {label} round {r}: " + ", ".join(f"{n} {per[n][-1]:.1f}" for n in per), flush=True)
        summary = {}
        for name, xs in per.items():
            ratios = [x / c for x, c in zip(xs, per["cudnn"])]
            summary[name] = {"tflops_rounds": xs, "median": float(np.median(xs)), "min": min(xs), "max": max(xs),
                             "ratio_to_cudnn_per_round": ratios, "ratio_median": float(np.median(ratios))}
            print(f"{label:14s} {name:28s} {np.median(xs):6.1f} TFLOP/s ({min(xs):.1f}-{max(xs):.1f}) "
                  f"x cuDNN {np.median(ratios):.3f}", flush=True)
        result.setdefault("timing", {})[label] = summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    result = {"meta": run_metadata()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bits(result)
    (out / "probe_mgpu_direct_out.json").write_text(json.dumps(result, indent=1))
    timing(result, args.rounds)
    (out / "probe_mgpu_direct_out.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
