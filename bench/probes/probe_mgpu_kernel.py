"""Probe: our Mosaic GPU (Hopper) flash-attention forward, pallas_kernels/mgpu_attention.py (issue 28).

    python bench/probes/probe_mgpu_kernel.py --out DIR       # on the GPU machine: -> DIR/probe_mgpu_kernel.json
    python bench/probes/probe_mgpu_kernel.py --cpu-smoke     # here: tiny versions in Mosaic GPU's CPU interpreter

(a) Correctness against a float64 NumPy reference (tests/kernel_reference.attention_ref) on small shapes, in the
    warpgroup lowering: causal and not, the default and explicit query offsets (with rows that see no key),
    per-row kv lengths, D 64, a bfloat16 output, Tq = Tk = 1000 (no multiple of any tile: padded inside), two
    sequences packed in one batch row (kv_start); then the other configs of the timing sweep (the lane lowering
    among them) and an O aliased over Q and K, once each, on the case with offsets and empty rows. PASS when o's
    relative error <= 1e-2 and lse's absolute error <= 1e-2 (the bf16 tolerances of
    tests/test_kernels_attention.py) and rows that see no key give exactly o = 0, lse = -inf.
(b) The streaming contract, bit for bit: causal Tq = Tk = 4096, keys in blocks of 1024 and of 2048 (the raw state
    carried by attention_state_mgpu, the last block through attention_with_lse_mgpu(state=...)) against one
    call over all the keys, default config. PASS when o and lse are identical.
(c) Timing, B1 Hq32 Hkv8 D128 bf16: causal 8K and 32K, non-causal 4K, against cuDNN
    (jax.nn.dot_product_attention), our Triton kernel (pallas_kernels.attention_with_lse with its launch
    parameters given, which keeps it off the Hopper kernel) and torch SDPA, over the 4 best configs of
    (block_q, block_kv, max_concurrent_steps, out dtype, lowering). Figures are TFLOP/s (causal counts half the
    score matrix) from the median, min and max of >= 5 timed groups after warm-up (bench_kernels.time_jax's
    scheme), with each config's max |do| / |dlse| against Triton.

Every check and config runs in its own try/except (the first line of its error is printed and kept), results
are rewritten after each section, and timing stops starting new configs after a time budget, so the run ends
within 3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

# JAX preallocates 75% of the GPU by default; leave room for torch's SDPA in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import mgpu_attention as mga  # noqa: E402
from bench_kernels import attn_flops, rand  # noqa: E402
from common import run_metadata  # noqa: E402
from kernel_reference import attention_ref, rel_err  # noqa: E402

START = time.perf_counter()
TIME_BUDGET_S = 150  # no new timing config starts after this (compile + timing of one is < 20 s)
O_TOL, LSE_TOL = 1e-2, 1e-2
B, HQ, HKV, D = 1, 32, 8, 128

# (name, B, Tq, Tk, Hq, Hkv, D, causal, q_offset (None: Tk - Tq), kv_lengths, out_dtype)
CASES = [
    ("causal_square", 1, 256, 256, 8, 2, 128, True, None, None, jnp.float32),
    ("noncausal_b2", 2, 512, 512, 8, 2, 128, False, None, None, jnp.float32),
    ("causal_default_offset", 1, 256, 1024, 8, 2, 128, True, None, None, jnp.float32),
    ("causal_offsets_empty_rows", 2, 512, 1024, 8, 2, 128, True, [100, -64], None, jnp.float32),
    ("causal_kv_lengths", 2, 1024, 1024, 8, 2, 128, True, None, [1000, 333], jnp.float32),
    ("noncausal_kv_lengths_zero", 2, 256, 1024, 8, 2, 128, False, None, [700, 0], jnp.float32),
    ("causal_d64", 1, 512, 512, 8, 2, 64, True, None, None, jnp.float32),
    ("causal_bf16_out", 1, 512, 512, 8, 2, 128, True, None, None, jnp.bfloat16),
    ("causal_odd_1000", 1, 1000, 1000, 8, 2, 128, True, None, None, jnp.float32),
]
# Two causal sequences packed in each batch row (kv_start): (name, B, T, Hq, Hkv, D, first sequence's length per row).
PACKED = ("causal_packed_two_sequences", 2, 1024, 8, 2, 128, [700, 333])
# Streaming, causal, B1: (T, key block sizes, (Hq, Hkv, D)).
STREAMED = (4096, (1024, 2048), (8, 2, 128))
# CPU interpreter (jax 0.10/0.11 on this machine): tiny shapes only, it runs every op through Python.
SMOKE_CASES = [
    ("smoke_causal_offsets_kvlen", 2, 128, 256, 2, 1, 64, True, [64, -40], [250, 200], jnp.float32),
    ("smoke_noncausal_odd", 1, 100, 150, 1, 1, 64, False, None, None, jnp.float32),
]
SMOKE_PACKED = ("smoke_packed", 1, 128, 1, 1, 64, [50])
SMOKE_STREAMED = (128, (64,), (1, 1, 64))
SMOKE_CFG = dict(block_q=64, block_kv=64, max_concurrent_steps=2)

# (label, block_q, block_kv, max_concurrent_steps, out_dtype, semantics); the first is the default.
SWEEP = [
    ("bq64 bkv128 s2 f32 wg", 64, 128, 2, jnp.float32, "warpgroup"),
    ("bq64 bkv128 s2 f32 lane", 64, 128, 2, jnp.float32, "lane"),
    ("bq64 bkv128 s2 bf16 wg", 64, 128, 2, jnp.bfloat16, "warpgroup"),
    ("bq64 bkv128 s3 bf16 wg", 64, 128, 3, jnp.bfloat16, "warpgroup"),
]
# Larger key blocks (FlashAttention-3 takes 176 keys a step for D 128 without a mask); their float32 O is
# aliased over Q and K to fit: `--sweep blocks`.
SWEEP_BLOCKS = [
    SWEEP[0],
    ("bq64 bkv192 s2 f32 wg", 64, 192, 2, jnp.float32, "warpgroup"),
    ("bq64 bkv128 s3 f32 wg", 64, 128, 3, jnp.float32, "warpgroup"),
    ("bq64 bkv256 s1 f32 wg", 64, 256, 1, jnp.float32, "warpgroup"),
]
# Correctness only: a config whose float32 O does not fit beside Q and K, so it is aliased over them.
ALIASED = ("bq64 bkv128 s3 f32 wg (O aliased)", 64, 128, 3, jnp.float32, "warpgroup")
SHAPES = [("causal 8K", 8192, True), ("causal 32K", 32768, True), ("non-causal 4K", 4096, False)]


def first_line(e: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:400]


def time_stats(fn, *args, reps: int = 7, warmup: int = 2) -> dict:
    """bench_kernels.time_jax's scheme (calls queued back to back in groups of ~20 ms, each group waited
    for), keeping min and max besides the median: seconds per call."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return {"median_s": float(np.median(samples)), "min_s": float(min(samples)), "max_s": float(max(samples)),
            "reps": reps, "inner": inner}


def time_torch_stats(fn, reps: int = 7, inner: int = 3) -> dict:
    import torch
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    return {"median_s": float(np.median(samples)), "min_s": float(min(samples)), "max_s": float(max(samples)),
            "reps": reps, "inner": inner}


def tflops(flops: float, stats: dict) -> dict:
    # The fastest group gives the highest rate: TFLOP/s at the median, and at the max and min times.
    return {"tflops": flops / stats["median_s"] / 1e12, "tflops_lo": flops / stats["max_s"] / 1e12,
            "tflops_hi": flops / stats["min_s"] / 1e12, **stats}


def inputs(name: str, b: int, tq: int, tk: int, hq: int, hkv: int, d: int):
    rng = np.random.default_rng(sum(map(ord, name)))  # a seed that is the same in every process
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d)))


def check_case(case, *, semantics: str, interpret: bool = False, kv_start: np.ndarray | None = None,
               **cfg) -> dict:
    """One call against float64; kv_start [B, Tq] packs sequences."""
    name, b, tq, tk, hq, hkv, d, causal, q_offset, kv_lengths, out_dtype = case
    q, k, v = inputs(name, b, tq, tk, hq, hkv, d)
    kw = dict(causal=causal, out_dtype=out_dtype, semantics=semantics, interpret=interpret, **cfg)
    if q_offset is not None:
        kw["q_offset"] = jnp.asarray(q_offset, jnp.int32)
    if kv_lengths is not None:
        kw["kv_lengths"] = jnp.asarray(kv_lengths, jnp.int32)
    if kv_start is not None:
        kw["kv_start"] = jnp.asarray(kv_start)
    row = {"case": name, "semantics": semantics, "shape": [b, tq, tk, hq, hkv, d], "causal": causal,
           "q_offset": q_offset, "kv_lengths": kv_lengths, "out_dtype": jnp.dtype(out_dtype).name,
           "packed": kv_start is not None, **cfg}
    try:
        if not interpret:
            row["is_supported"] = mga.is_supported(q, k, v, out_dtype=out_dtype, **cfg)
        o, lse = mga.attention_with_lse_mgpu(q, k, v, **kw)
        o = np.asarray(o.astype(jnp.float32), np.float64)
        lse = np.asarray(lse, np.float64)
        assert o.shape == (b, tq, hq, d) and lse.shape == (b, hq, tq), (o.shape, lse.shape)
        ref_o, ref_lse = attention_ref(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), causal=causal,
                                       q_offset=tk - tq if q_offset is None else q_offset, kv_len=kv_lengths,
                                       kv_start=kv_start)
        empty = ~np.isfinite(ref_lse)
        seen = ~empty
        row["empty_rows"] = int(empty.sum())
        row["nan"] = bool(np.isnan(o).any() or np.isnan(lse).any())
        row["empty_ok"] = bool(np.array_equal(np.isneginf(lse), empty)
                               and np.all(o[np.swapaxes(empty, -1, -2)] == 0.0))
        row["max_abs_do"] = float(np.max(np.abs(o - ref_o)))
        row["rel_do"] = rel_err(o, ref_o)
        row["max_abs_dlse"] = float(np.max(np.abs(lse[seen] - ref_lse[seen]))) if seen.any() else 0.0
        row["pass"] = bool(not row["nan"] and row["empty_ok"] and row["rel_do"] <= O_TOL
                           and row["max_abs_dlse"] <= LSE_TOL)
        print(f"{'PASS' if row['pass'] else 'FAIL'} {name:28s} {semantics:9s} max|do| {row['max_abs_do']:.3e} "
              f"(rel {row['rel_do']:.2e}) max|dlse| {row['max_abs_dlse']:.3e} empty rows {row['empty_rows']} "
              f"ok={row['empty_ok']} nan={row['nan']}", flush=True)
    except Exception as e:  # noqa: BLE001
        row["pass"] = False
        row["error"] = first_line(e)
        print(f"FAIL {name:28s} {semantics:9s} ERROR {row['error']}", flush=True)
    return row


def check_packed(packed, *, interpret: bool = False, **cfg) -> dict:
    """Two causal sequences in each batch row: the first `lengths[b]` queries start at key 0, the rest at
    lengths[b], so no query sees the other sequence."""
    name, b, t, hq, hkv, d, lengths = packed
    kv_start = np.stack([np.where(np.arange(t) < n, 0, n) for n in lengths]).astype(np.int32)
    row = check_case((name, b, t, t, hq, hkv, d, True, 0, None, jnp.float32), semantics="warpgroup",
                     interpret=interpret, kv_start=kv_start, **cfg)
    row["first_sequence_lengths"] = lengths
    return row


def check_streamed(t: int, blocks, heads, *, semantics: str = "warpgroup", interpret: bool = False,
                   **cfg) -> list[dict]:
    """Causal attention of t queries over t keys, for each block size the keys in blocks of it (q_offset
    relative to each block's first key; the raw state carried between calls, the last call finishing) against
    one call over all of them: the same bits."""
    name = f"streamed_{t}"
    q, k, v = inputs(name, 1, t, t, *heads)
    kw = dict(causal=True, semantics=semantics, interpret=interpret, **cfg)
    rows = []
    try:
        whole_o, whole_lse = mga.attention_with_lse_mgpu(q, k, v, q_offset=0, **kw)
        whole_o, whole_lse = np.asarray(whole_o), np.asarray(whole_lse)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {name:28s} one call ERROR {first_line(e)}", flush=True)
        return [{"case": name, "pass": False, "error": first_line(e)}]
    for block in blocks:
        row = {"case": name, "block": block, "shape": list(q.shape), **cfg}
        try:
            state = None
            for start in range(0, t - block, block):
                keys = slice(start, start + block)
                state = mga.attention_state_mgpu(q, k[:, keys], v[:, keys], state, q_offset=-start, **kw)
            last = t - block
            o, lse = mga.attention_with_lse_mgpu(q, k[:, last:], v[:, last:], state=state, q_offset=-last, **kw)
            o, lse = np.asarray(o), np.asarray(lse)
            row["o_bitwise"] = bool(np.array_equal(o, whole_o))
            row["lse_bitwise"] = bool(np.array_equal(lse, whole_lse))
            row["o_entries_differing"] = int(np.sum(o != whole_o))
            row["max_abs_do"] = float(np.max(np.abs(o - whole_o)))
            row["max_abs_dlse"] = float(np.max(np.abs(lse - whole_lse)))
            row["finite"] = bool(np.isfinite(o).all() and np.isfinite(lse).all())
            row["pass"] = row["o_bitwise"] and row["lse_bitwise"] and row["finite"]
            print(f"{'PASS' if row['pass'] else 'FAIL'} {name:28s} blocks of {block}: o bitwise {row['o_bitwise']} "
                  f"({row['o_entries_differing']} entries differ, max {row['max_abs_do']:.3e}), lse bitwise "
                  f"{row['lse_bitwise']} (max {row['max_abs_dlse']:.3e})", flush=True)
        except Exception as e:  # noqa: BLE001
            row["pass"] = False
            row["error"] = first_line(e)
            print(f"FAIL {name:28s} blocks of {block} ERROR {row['error']}", flush=True)
        rows.append(row)
    return rows


def torch_sdpa(t: int, causal: bool, flops: float) -> dict:
    import torch
    import torch.nn.functional as F
    tq_ = torch.randn(B, HQ, t, D, device="cuda", dtype=torch.bfloat16)
    tk_ = torch.randn(B, HKV, t, D, device="cuda", dtype=torch.bfloat16)
    tv_ = torch.randn(B, HKV, t, D, device="cuda", dtype=torch.bfloat16)
    try:
        return tflops(flops, time_torch_stats(lambda: F.scaled_dot_product_attention(
            tq_, tk_, tv_, is_causal=causal, enable_gqa=True)))
    finally:
        del tq_, tk_, tv_
        torch.cuda.empty_cache()


def time_shape(label: str, t: int, causal: bool, result: dict, sweep: list) -> None:
    if time.perf_counter() - START > TIME_BUDGET_S:
        result.setdefault("timing", {})[label] = {"error": "skipped: time budget"}
        print(f"  {label}: skipped (time budget)", flush=True)
        return
    ks = jax.random.split(jax.random.key(t), 3)
    q = rand(ks[0], (B, t, HQ, D), jnp.bfloat16)
    k = rand(ks[1], (B, t, HKV, D), jnp.bfloat16)
    v = rand(ks[2], (B, t, HKV, D), jnp.bfloat16)
    flops = attn_flops(B, HQ, t, t, D, causal)
    row = result.setdefault("timing", {}).setdefault(label, {"shape": [B, t, t, HQ, HKV, D], "causal": causal})

    def record(name, fn):
        try:
            row[name] = fn()
            r = row[name]
            extra = "".join(f" {key} {r[key]:.3g}" for key in ("max_abs_do", "max_abs_dlse") if key in r)
            print(f"  {label:14s} {name:36s} {r['tflops']:6.1f} TFLOP/s (min..max {r['tflops_lo']:.1f}.."
                  f"{r['tflops_hi']:.1f}){extra}", flush=True)
        except Exception as e:  # noqa: BLE001
            row[name] = {"error": first_line(e)}
            print(f"  {label:14s} {name:36s} ERROR {row[name]['error']}", flush=True)

    cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
    record("cudnn", lambda: tflops(flops, time_stats(cud, q, k, v)))
    # Launch parameters given (Triton's defaults): attention_with_lse keeps to Triton instead of this kernel.
    triton_cfg = pk.default_attention_config(jnp.bfloat16)
    triton = jax.jit(lambda q, k, v: pk.attention_with_lse(q, k, v, causal=causal, **triton_cfg))
    record("triton (ours)", lambda: tflops(flops, time_stats(triton, q, k, v)))
    record("torch sdpa", lambda: torch_sdpa(t, causal, flops))
    try:
        o_ref, lse_ref = triton(q, k, v)
        o_ref = o_ref.astype(jnp.float32)
    except Exception:  # noqa: BLE001
        o_ref = lse_ref = None

    for name, bq, bkv, steps, out_dtype, sem in sweep:
        if time.perf_counter() - START > TIME_BUDGET_S:
            row["mgpu " + name] = {"error": "skipped: time budget"}
            print(f"  {label:14s} mgpu {name}: skipped (time budget)", flush=True)
            continue

        def run(bq=bq, bkv=bkv, steps=steps, out_dtype=out_dtype, sem=sem):
            f = jax.jit(lambda q, k, v: mga.attention_with_lse_mgpu(
                q, k, v, causal=causal, q_offset=0, out_dtype=out_dtype, block_q=bq, block_kv=bkv,
                max_concurrent_steps=steps, semantics=sem))
            o, lse = f(q, k, v)
            r = tflops(flops, time_stats(f, q, k, v))
            if o_ref is not None:  # the same softmax, both with P rounded to bf16: agree to ~1e-2
                r["max_abs_do"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref)))
                r["max_abs_dlse"] = float(jnp.max(jnp.abs(lse - lse_ref)))
            return r

        record("mgpu " + name, run)


def write(result: dict, out: str | None) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "probe_mgpu_kernel.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="directory for probe_mgpu_kernel.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny correctness cases in the CPU interpreter")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--sweep", choices=("default", "blocks"), default="default", help="the configs timed")
    args = ap.parse_args()
    sweep = SWEEP if args.sweep == "default" else SWEEP_BLOCKS
    result = {"meta": run_metadata(), "tolerances": {"o_rel": O_TOL, "lse_abs": LSE_TOL}}
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)

    if args.cpu_smoke:
        rows = [check_case(c, semantics="lane", interpret=True, **SMOKE_CFG) for c in SMOKE_CASES]
        rows.append(check_packed(SMOKE_PACKED, interpret=True, **SMOKE_CFG))
        rows += check_streamed(*SMOKE_STREAMED, interpret=True, **SMOKE_CFG)
        result["correctness"] = rows
        write(result, args.out)
        return 0 if all(r["pass"] for r in rows) else 1

    rows = [check_case(c, semantics="warpgroup", **mga.DEFAULT_CONFIG) for c in CASES]
    rows.append(check_packed(PACKED, **mga.DEFAULT_CONFIG))
    # The other configs of the sweep, and an aliased O, once each on the case with offsets and empty rows.
    for _, bq, bkv, steps, out_dtype, sem in sweep[1:] + [ALIASED]:
        c = list(CASES[3])
        c[-1] = out_dtype
        rows.append(check_case(tuple(c), semantics=sem, block_q=bq, block_kv=bkv, max_concurrent_steps=steps))
    rows += check_streamed(*STREAMED, **mga.DEFAULT_CONFIG)
    result["correctness"] = rows
    n_pass = sum(r["pass"] for r in rows)
    print(f"correctness: {n_pass} passed, {len(rows) - n_pass} failed ({time.perf_counter() - START:.0f} s)",
          flush=True)
    write(result, args.out)

    if not args.skip_timing:
        for label, t, causal in SHAPES:
            time_shape(label, t, causal, result, sweep)
            write(result, args.out)
    result["wall_s"] = time.perf_counter() - START
    write(result, args.out)
    print(f"done in {result['wall_s']:.0f} s", flush=True)
    return 0 if n_pass == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
