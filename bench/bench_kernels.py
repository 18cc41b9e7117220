"""Benchmark the pallas_kernels on the GPU (their correctness: `pytest tests/test_kernels_*.py` on a GPU machine
runs the same kernels compiled against the float64 references).

    python bench/bench_kernels.py --out DIR            # figures -> DIR/kernels.json, kernels.md

Every figure is written with its peer (cuDNN through jax.nn.dot_product_attention, torch SDPA
when torch imports, the measured device copy bandwidth, or the full attention a helper serves),
the shape and the dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from common import run_metadata  # noqa: E402
from jax_offload.config import XATTN_DEFAULTS  # noqa: E402


# ----------------------------------------------------------------------------- timing

ATTENTION_ROUNDS = 20


def jax_group(fn, *args, inner: int):
    """A function timing one group of `inner` calls of `fn` queued back to back: seconds per call."""
    def group() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / inner
    return group


def torch_group(fn, inner: int = 5):
    """A function timing one group of `inner` calls of `fn` by CUDA events: seconds per call."""
    import torch

    def group() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    return group


def interleaved_samples(groups: dict, reps: int) -> dict[str, list[float]]:
    """`reps` rounds, each timing one group of every entry, the order rotated from round to round: a clock or
    temperature drift during the run reaches every entry alike, and each round gives a paired ratio."""
    for group in groups.values():  # warm-up
        group()
    names = list(groups)
    samples = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            samples[n].append(groups[n]())
    return samples


def inner_calls(fn, *args) -> int:
    """Calls per group for ~20 ms of GPU work, after two warm-up calls."""
    for _ in range(2):
        out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))


def time_jax(fn, *args, reps: int = 10, inner: int | None = None) -> float:
    """Median seconds per call of `reps` groups of `inner` calls queued back to back, so that dispatch overlaps the
    GPU (default: ~20 ms of GPU work a group), after a warm-up."""
    group = jax_group(fn, *args, inner=inner or inner_calls(fn, *args))
    return float(np.median([group() for _ in range(reps)]))


def tflops_spread(flops: float, samples: list[float]) -> dict:
    """TFLOP/s at the median, fastest and slowest group."""
    return dict(median=flops / float(np.median(samples)) / 1e12, min=flops / max(samples) / 1e12,
                max=flops / min(samples) / 1e12)


def attn_flops(b, hq, tq, tk, d, causal) -> float:
    full = 4.0 * b * hq * tq * tk * d
    return full / 2 if causal and tq == tk else full


def rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


# ----------------------------------------------------------------------------- figures

class Report:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, **row):
        self.rows.append(row)
        value = row.get("value")
        peer = row.get("peer_value")
        print(f"{row['name']:<34} {row.get('shape', ''):<34} {row.get('dtype', ''):<9} "
              f"{_fmt(value)} {row.get('unit', ''):<8} peer {row.get('peer', '')}: {_fmt(peer)} "
              f"ratio {_fmt(row.get('ratio'))} {row.get('verdict', '')}", flush=True)

    def error(self, name, exc):
        msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-1500:]
        self.rows.append(dict(name=name, error=msg))
        print(f"{name}: ERROR {msg}", flush=True)


def _fmt(x):
    return "-" if x is None else (f"{x:9.3f}" if isinstance(x, float) else str(x))


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = jnp.ones((1 << 29,), jnp.bfloat16)  # 1 GiB
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0009765625))
    t = time_jax(f, x, reps=10, inner=5)
    return 2 * x.nbytes / t


def bench_attention(rep: Report, name, b, t, hq, hkv, d, causal, target_ratio=1.0):
    """Ours against cuDNN and torch SDPA, timed in ATTENTION_ROUNDS interleaved rounds (`interleaved_samples`)."""
    ks = jax.random.split(jax.random.key(1), 3)
    q = rand(ks[0], (b, t, hq, d), jnp.bfloat16)
    k = rand(ks[1], (b, t, hkv, d), jnp.bfloat16)
    v = rand(ks[2], (b, t, hkv, d), jnp.bfloat16)
    flops = attn_flops(b, hq, t, t, d, causal)
    shape = f"B{b} T{t} Hq{hq} Hkv{hkv} D{d}" + (" causal" if causal else "")
    groups = {}
    ours = jax.jit(lambda q, k, v: pk.attention_with_lse(q, k, v, causal=causal))
    groups["ours"] = jax_group(ours, q, k, v, inner=inner_calls(ours, q, k, v))
    try:
        cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
        groups["cudnn"] = jax_group(cud, q, k, v, inner=inner_calls(cud, q, k, v))
    except Exception as e:  # noqa: BLE001
        rep.error(f"{name}/cudnn", e)
    try:
        import torch
        import torch.nn.functional as F
        tq_ = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
        tk_ = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        tv_ = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        groups["torch_sdpa"] = torch_group(lambda: F.scaled_dot_product_attention(
            tq_, tk_, tv_, is_causal=causal, enable_gqa=True))
    except Exception as e:  # noqa: BLE001
        rep.error(f"{name}/torch_sdpa", e)
    samples = interleaved_samples(groups, ATTENTION_ROUNDS)
    spread = {n: tflops_spread(flops, s) for n, s in samples.items()}
    tf, sp = spread["ours"]["median"], spread["ours"]
    if "cudnn" in spread:
        cud = spread["cudnn"]["median"]
        per_round = [c / o for o, c in zip(samples["ours"], samples["cudnn"])]
        rep.add(name=name, shape=shape, dtype="bfloat16", value=tf, unit="TFLOP/s",
                spread=f"{sp['min']:.1f}-{sp['max']:.1f}", peer="cudnn", peer_value=cud,
                peer_spread=f"{spread['cudnn']['min']:.1f}-{spread['cudnn']['max']:.1f}", ratio=tf / cud,
                ratio_per_round=f"{np.median(per_round):.3f} ({min(per_round):.3f}-{max(per_round):.3f})",
                target=f">= {target_ratio}x cudnn", verdict="MEETS" if tf / cud >= target_ratio else "BELOW")
    if "torch_sdpa" in spread:
        sdpa = spread["torch_sdpa"]
        per_round = [s_ / o for o, s_ in zip(samples["ours"], samples["torch_sdpa"])]
        rep.add(name=name + "/torch_sdpa", shape=shape, dtype="bfloat16", value=sdpa["median"],
                unit="TFLOP/s", spread=f"{sdpa['min']:.1f}-{sdpa['max']:.1f}", peer="ours", peer_value=tf,
                peer_spread=f"{sp['min']:.1f}-{sp['max']:.1f}", ratio=tf / sdpa["median"],
                ratio_per_round=f"{np.median(per_round):.3f} ({min(per_round):.3f}-{max(per_round):.3f})")


def bench_decode(rep: Report, copy_bw):
    b, s, hq, hkv, d = 1, 65536, 32, 8, 128
    ks = jax.random.split(jax.random.key(2), 3)
    q = rand(ks[0], (b, hq, d), jnp.bfloat16)
    k = rand(ks[1], (b, s, hkv, d), jnp.bfloat16)
    v = rand(ks[2], (b, s, hkv, d), jnp.bfloat16)
    kv_bytes = k.nbytes + v.nbytes
    shape = f"B{b} S{s} Hq{hq} Hkv{hkv} D{d}"
    fn = jax.jit(pk.decode_attention_with_lse)
    t = time_jax(fn, q, k, v, reps=20)
    ratio = kv_bytes / t / copy_bw
    rep.add(name="decode_attention_with_lse", shape=shape, dtype="bfloat16", value=kv_bytes / t / 1e9,
            unit="GB/s", peer="device copy (read+write)", peer_value=copy_bw / 1e9,
            ratio=ratio, time_us=t * 1e6, target=">= 0.75x copy",
            verdict="MEETS" if ratio >= 0.75 else "BELOW")
    try:
        cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q[:, None], k, v, implementation="cudnn"))
        t = time_jax(cud, q, k, v, reps=20)
        rep.add(name="decode/cudnn", shape=shape, dtype="bfloat16", value=kv_bytes / t / 1e9,
                unit="GB/s", peer="device copy (read+write)", peer_value=copy_bw / 1e9,
                ratio=kv_bytes / t / copy_bw, time_us=t * 1e6)
    except Exception as e:  # noqa: BLE001
        rep.error("decode/cudnn", e)


def bench_merge(rep: Report, copy_bw):
    n, b, t, h, d = 8, 1, 4096, 32, 128
    ks = jax.random.split(jax.random.key(3), 2)
    o = rand(ks[0], (n, b, t, h, d), jnp.float32)
    lse = rand(ks[1], (n, b, h, t), jnp.float32)
    t_merge = time_jax(pk.merge_states_n, o, lse, reps=20)
    moved = o.nbytes + lse.nbytes + o.nbytes // n + lse.nbytes // n
    shape = f"N{n} B{b} T{t} H{h} D{d}"
    # The attention these merges serve: a 4K query chunk over 32K keys (8 blocks of 4K).
    kq = jax.random.split(jax.random.key(4), 3)
    q = rand(kq[0], (1, 4096, 32, 128), jnp.bfloat16)
    k = rand(kq[1], (1, 32768, 8, 128), jnp.bfloat16)
    vv = rand(kq[2], (1, 32768, 8, 128), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: pk.attention_with_lse(q, k, v, causal=True, q_offset=28672))
    t_attn = time_jax(fn, q, k, vv)
    rep.add(name="merge_states_n", shape=shape, dtype="float32", value=t_merge * 1e3, unit="ms",
            peer="attention 4K q x 32K kv causal", peer_value=t_attn * 1e3,
            ratio=t_merge / t_attn, bandwidth_vs_copy=moved / t_merge / copy_bw)
    o2 = o[:2]
    l2 = lse[:2]
    t_pair = time_jax(pk.merge_states, o2[0], l2[0], o2[1], l2[1], reps=20)
    moved2 = 3 * o2[0].nbytes + 3 * l2[0].nbytes
    rep.add(name="merge_states", shape=f"B{b} T{t} H{h} D{d}", dtype="float32",
            value=t_pair * 1e3, unit="ms", peer="device copy (read+write)",
            peer_value=copy_bw / 1e9, ratio=moved2 / t_pair / copy_bw)


def bench_xattn(rep: Report):
    b, t, hq, hkv, d = 1, 32768, 32, 8, 128
    stride, block = XATTN_DEFAULTS["xattn_stride"], XATTN_DEFAULTS["xattn_block"]
    ks = jax.random.split(jax.random.key(5), 3)
    q = rand(ks[0], (b, t, hq, d), jnp.bfloat16)
    k = rand(ks[1], (b, t, hkv, d), jnp.bfloat16)
    v = rand(ks[2], (b, t, hkv, d), jnp.bfloat16)
    shape = f"B{b} T{t} Hq{hq} Hkv{hkv} D{d} S{stride} block{block}"
    attn = jax.jit(lambda q, k, v: pk.attention_with_lse(q, k, v, causal=True))
    t_attn = time_jax(attn, q, k, v, reps=5)
    est = jax.jit(lambda q, k: pk.xattn_estimate(q, k, block_size=block, stride=stride,
                                                  threshold=0.9))
    t_est = time_jax(est, q, k, reps=5)
    ratio = t_est / t_attn
    rep.add(name="xattn_estimate", shape=shape, dtype="bfloat16", value=t_est * 1e3,
            unit="ms", peer="attention_with_lse causal (ours)", peer_value=t_attn * 1e3,
            ratio=ratio, target="<= 0.15x", verdict="MEETS" if ratio <= 0.15 else "BELOW")


def write_outputs(rep: Report, out_dir: str, extra: dict):
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(extra)
    with open(os.path.join(out_dir, "kernels.json"), "w") as f:
        json.dump(dict(meta=meta, results=rep.rows), f, indent=1, default=str)
    lines = ["# pallas_kernels benchmark", "",
             f"device: {meta['device']}; jax {meta['jax']}; torch {meta.get('torch', 'absent')}; "
             f"{meta['date']}", "",
             "Timed figures: the median of 10 groups of calls queued back to back; spreads (slowest-fastest "
             f"group) where given. Attention: {ATTENTION_ROUNDS} rounds, each timing one group of ours, cuDNN's and "
             "torch SDPA's in turn; 'ratio' is ours over the peer's median, 'per round' the median (min-max) of the "
             "rounds' ratios.", "",
             "| figure | shape | dtype | value | spread | unit | peer | peer value | peer spread | ratio | per round | "
             "target | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep.rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:120]} | | | | | | | | | | | |")
            continue
        lines.append("| " + " | ".join(str(_fmt(r.get(c)) if isinstance(r.get(c), float)
                                            else r.get(c, "")) for c in
                                       ("name", "shape", "dtype", "value", "spread", "unit", "peer",
                                        "peer_value", "peer_spread", "ratio", "ratio_per_round", "target",
                                        "verdict")) + " |")
    with open(os.path.join(out_dir, "kernels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for kernels.json and kernels.md")
    args = ap.parse_args()
    meta = run_metadata() | {"backend": jax.default_backend()}
    print(meta, flush=True)
    rep = Report()
    copy_bw = copy_bandwidth()
    rep.add(name="device copy bandwidth", shape="1 GiB bf16", dtype="bfloat16",
            value=copy_bw / 1e9, unit="GB/s", peer="-")
    plan = [
        ("attention causal 8K", lambda: bench_attention(
            rep, "attention causal 8K", 1, 8192, 32, 8, 128, True, target_ratio=1.0)),
        ("attention noncausal 4K", lambda: bench_attention(
            rep, "attention noncausal 4K gqa4", 1, 4096, 32, 8, 128, False, target_ratio=1.0)),
        ("attention causal 32K", lambda: bench_attention(
            rep, "attention causal 32K", 1, 32768, 32, 8, 128, True, target_ratio=1.0)),
        ("decode", lambda: bench_decode(rep, copy_bw)),
        ("merge", lambda: bench_merge(rep, copy_bw)),
        ("xattn", lambda: bench_xattn(rep)),
    ]
    for name, step in plan:
        try:
            step()
        except Exception as e:  # noqa: BLE001
            rep.error(name, e)
        write_outputs(rep, args.out, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
