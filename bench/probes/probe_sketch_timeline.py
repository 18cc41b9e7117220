"""Where a pass of sketch scoring over 30 layers spends its GPU time beyond the Hopper kernel's own duration.

ncu gives one 256K launch of the kernel 55.3 us on an H100 (80% of DRAM peak), i.e. 1.66 ms for 30 layers, while
the 30-layer programs time 2.0-2.2 ms a pass. This probe times two 30-layer programs at 256K as probe_sketch_mgpu
does ((t4 - t1) / 3, medians of 20 waited calls, 5 rounds): `kernel` (the kernel and its wrapper, as
sketch_page_lse) and `engine` (SketchScore.page_scores: the kernel and the softmax over pages, what bench_sparse.py
times), then records a jax.profiler trace of 3 calls of each program (once and 4 times over) and writes each call's GPU span
(first kernel's start to last kernel's end), a summary per kernel name and the gaps between consecutive kernels, the
programs' wall time (median of 20 waited calls), and every GPU event of the programs that score the layers once. Run once per XLA_FLAGS setting; writes
probe_sketch_timeline.<TAG>.json under $OUT.

    TAG=default python bench/probes/probe_sketch_timeline.py
"""
import glob
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import pallas_kernels  # noqa: E402
from common import run_metadata  # noqa: E402
from jax_offload.sparse.sketch import SketchScore  # noqa: E402

HKV, G, D, PAGE, LAYERS, REPEATS, ROUNDS, TOKENS = 8, 4, 128, 16, 30, 4, 5, 262144


def programs():
    scorer = SketchScore("int4", PAGE)
    pages = TOKENS // PAGE
    fns = {"kernel": lambda q, c, s, n: pallas_kernels.sketch_page_lse(q.reshape(HKV, G, D), c, s, bits=4),
           "engine": lambda q, c, s, n: scorer.page_scores("pallas", q, (c, s), n, pages)}
    return {(name, r): jax.jit(lambda q, c, s, n, f=f, r=r: [f(q[i] + jnp.bfloat16(j), c[i], s[i], n)
                                                         for j in range(r) for i in range(LAYERS)])
            for name, f in fns.items() for r in (1, REPEATS)}


def gpu_events(trace_dir: str) -> dict:
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    data = jax.profiler.ProfileData.from_file(path)
    out = {}
    for plane in data.planes:
        if "GPU" not in plane.name and "gpu" not in plane.name:
            continue
        for line in plane.lines:
            events = [(e.name[:80], e.start_ns, e.duration_ns) for e in line.events]
            if events:
                out[f"{plane.name} | {line.name}"] = events
    return out


def summarize(events: list) -> dict:
    events = sorted(events, key=lambda e: e[1])
    by_name = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur / 1e3)
    gaps = [(b[1] - (a[1] + a[2])) / 1e3 for a, b in zip(events, events[1:])]
    return {"per_name_us": {n: {"count": len(v), "median": float(np.median(v)), "sum": float(np.sum(v))}
                            for n, v in by_name.items()},
            "gaps_us": {"count": len(gaps), "median": float(np.median(gaps)) if gaps else None,
                        "p90": float(np.percentile(gaps, 90)) if gaps else None,
                        "sum": float(np.sum(gaps)) if gaps else None},
            "span_us": (events[-1][1] + events[-1][2] - events[0][1]) / 1e3 if events else None}


def calls(events: list) -> list[dict]:
    """The events cut into calls at gaps over 50 us: each call's GPU span and the sum of its kernels' durations."""
    events = sorted(events, key=lambda e: e[1])
    groups = [[events[0]]]
    for a, b in zip(events, events[1:]):
        if b[1] - (a[1] + a[2]) > 50_000:
            groups.append([])
        groups[-1].append(b)
    return [{"span_us": (g[-1][1] + g[-1][2] - g[0][1]) / 1e3, "kernels_us": sum(e[2] for e in g) / 1e3,
             "kernels": len(g)} for g in groups]


def main():
    tag = os.environ.get("TAG", "default")
    result = {**run_metadata(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "tokens": TOKENS, "layers": LAYERS}
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * LAYERS)
    pages = TOKENS // PAGE
    on_gpu = jax.default_backend() == "gpu"  # the CPU (a smoke test) scores the Triton kernel's bytes instead
    codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 8 if on_gpu else D // 2), jnp.uint32 if on_gpu else jnp.uint8)
             for k in keys[:LAYERS]]
    scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV * G, D), jnp.bfloat16)
    n = jnp.int32(pages)
    runs = programs()
    per_pass = {name: [] for name, r in runs if r == 1}
    for _ in range(ROUNDS):
        for name in per_pass:
            per_pass[name].append(common.gpu_ms_per_pass(lambda: runs[name, 1](q, codes, scales, n),
                                                         lambda: runs[name, REPEATS](q, codes, scales, n), REPEATS, 20))
        print(tag, json.dumps(per_pass), flush=True)
    result["gpu_ms_per_pass"] = {k: {"median": float(np.median(v)), "min": min(v), "max": max(v), "rounds": v}
                                 for k, v in per_pass.items()}
    result["traces"] = {}
    for (name, r), fn in runs.items():
        wall = common.call_seconds(lambda: fn(q, codes, scales, n), 20)
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for _ in range(3):
                    jax.block_until_ready(fn(q, codes, scales, n))
            lines = gpu_events(tmp)
        trace = {"wall_ms_median_of_20": float(np.median(wall)) * 1e3,
                 "lines": {k: {**summarize(v), "calls": calls(v)} for k, v in lines.items()}}
        if r == 1:
            trace["events"] = lines
        result["traces"][f"{name}_x{r}"] = trace
        print(tag, name, r, json.dumps({k: v for k, v in trace.items() if k != "events"})[:1500], flush=True)
    Path(os.environ.get("OUT", "."), f"probe_sketch_timeline.{tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
