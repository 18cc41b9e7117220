"""Where an offloaded decode step's time goes under tensor parallelism (issue 30), TP=1 against TP=2.

Llama-3.1-8B shape, random bf16 weights, KV offloaded at --ctx tokens (the store's blocks marked live: a decode
step reads them whatever they hold, so no prefill is needed), full decode, for each ring depth in --rings. Per
step: wall ms, and the host's time split into waiting (`block_until_ready` in the ring, i.e. the GPU or the links
are behind), starting transfers (`HostKVStore.fetch`) and the rest (Python and dispatching the layer programs).
If the host never waits, the step is as long as its dispatch, whatever the links could do. With --pages, also
full attention with every layer's pages read in place by the paged kernel (no ring, three calls a layer). With
--trace, one more step of each configuration runs under JAX's profiler (no Python tracer): its Perfetto trace is
kept as trace_tp<N>_<policy><ring>.json.gz, and summarised per track (each device's streams, the host's threads):
events, busy ms (the union of their intervals) and the longest kinds of event, in trace_summary.json.

    python bench/probes/probe_tp_decode.py --out $OUT/tp_decode
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_tp import link_bandwidth  # noqa: E402
from common import model_config, random_params, run_metadata, stats  # noqa: E402


class Clock:
    """Host seconds spent in the patched calls during one step."""

    def __init__(self):
        self.wait = self.fetch = 0.0

    def timed(self, fn, field: str):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t)
        return run


def load_trace(path: Path) -> tuple[list[dict], dict]:
    """A Perfetto JSON trace (.json.gz) -> its events and the names of its tracks: {(pid, None): process name,
    (pid, tid): thread name}."""
    events = json.load(gzip.open(path))["traceEvents"]
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    return events, names


def summarise_trace(path: Path) -> dict:
    """Per track of a Perfetto JSON trace ("process / thread"): events, busy ms, span ms, the 5 longest names."""
    events, names = load_trace(path)
    tracks: dict = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    out = {}
    for (pid, tid), spans in tracks.items():
        spans.sort()
        busy, end = 0.0, float("-inf")
        for lo, hi, _ in spans:  # the union of the intervals
            busy += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        by_name: dict = {}
        for lo, hi, name in spans:
            by_name[name] = by_name.get(name, 0.0) + (hi - lo) / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
        out[f"{names.get((pid, None), pid)} / {names.get((pid, tid), tid)}"] = {
            "events": len(spans), "busy_ms": busy / 1e3, "span_ms": (spans[-1][1] - spans[0][0]) / 1e3,
            "longest_ms": dict(top)}
    return out


def measure(cfg, params, tp, ctx: int, block_size: int, ring: int, steps: int, clock: Clock, policy: str,
            trace: Path | None = None) -> dict:
    import jax
    import numpy as np

    from jax_offload import LLM
    from jax_offload.attention import embed_tokens

    # "pages": every layer one pinned buffer whose pages the paged kernel reads in place over PCIe (zero copy), Quest
    # with a budget past the context choosing every page: full attention without the ring.
    pages = dict(decode_policy="quest", decode_budget=ctx + block_size, dense_layers=0) if policy == "pages" else {}
    llm = LLM.from_params(cfg, params, dtype="bfloat16", tensor_parallel_size=tp.size, max_model_len=ctx + block_size,
                          offload=True, block_size=block_size, num_ring_slots=ring, prefill="chunked", **pages)
    runner = llm._runner
    blocks = ctx // block_size
    runner.store.mark_written(blocks)
    runner._written = [blocks] * cfg.num_layers
    runner._tails = [runner._empty_tail() for _ in range(cfg.num_layers)]
    runner._tail_len = 0
    x = embed_tokens(params.embed, np.zeros((1, 1), np.int32))
    walls, waits, fetches = [], [], []
    for step in range(steps + 1):
        clock.wait = clock.fetch = 0.0
        t = time.perf_counter()
        out = runner.decode(x, blocks * block_size + step)
        dispatched = time.perf_counter() - t
        jax.block_until_ready(out)
        wall = time.perf_counter() - t
        if step:  # the first step compiles
            walls.append(wall * 1e3)
            waits.append((clock.wait + wall - dispatched) * 1e3)
            fetches.append(clock.fetch * 1e3)
    summary = None
    if trace is not None:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        folder = trace.with_suffix("")
        with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
            jax.block_until_ready(runner.decode(x, blocks * block_size + steps + 1))
        found = sorted(folder.rglob("perfetto_trace.json.gz"))
        if found:
            shutil.copy(found[-1], trace)
            summary = summarise_trace(trace)
        shutil.rmtree(folder, ignore_errors=True)
    runner.finish()
    rest = [w - a - f for w, a, f in zip(walls, waits, fetches)]
    pcie = blocks * runner.store.block_bytes * cfg.num_layers // tp.size
    del llm, runner
    gc.collect()  # the store's pinned buffers go before the next one is made
    return {"tp": tp.size, "policy": policy, "ring": ring, "trace_summary": summary, "decode_ms": stats(walls), "host_wait_ms": stats(waits),
            "host_fetch_ms": stats(fetches), "host_other_ms": stats(rest), "pcie_bytes_per_device": pcie,
            "groups_per_step": cfg.num_layers * -(-blocks // max(1, ring // 2))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=126976)
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--rings", default="4,16,64", help="ring depths of full decode through the ring")
    p.add_argument("--pages", action="store_true", help="also every page read in place (see `measure`)")
    p.add_argument("--trace", action="store_true", help="one step of each configuration under the profiler")
    p.add_argument("--tps", default="1,2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    import jax

    from jax_offload.kv import ring as ring_module
    from jax_offload.kv.host_store import HostKVStore
    from jax_offload.tensor_parallel import TensorParallel

    clock = Clock()
    ring_module.jax = types.SimpleNamespace(block_until_ready=clock.timed(jax.block_until_ready, "wait"),
                                            Array=jax.Array)
    HostKVStore.fetch = clock.timed(HostKVStore.fetch, "fetch")
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(a.shape)
    result = {"meta": run_metadata() | {"devices": jax.device_count(), "shape": a.shape, "ctx": a.ctx,
                                        "block_size": a.block_size}, "rows": []}
    for size in [int(s) for s in a.tps.split(",")]:
        if size > jax.device_count():
            continue
        tp = TensorParallel.create(size)
        params = random_params(cfg, jax.numpy.bfloat16, tp=tp)
        result[f"links_tp{size}"] = link_bandwidth(tp, 2**30)
        runs = [("full", int(r)) for r in a.rings.split(",")] + ([("pages", 4)] if a.pages else [])
        for policy, ring in runs:
            trace = a.out / f"trace_tp{size}_{policy}{ring}.json.gz" if a.trace else None
            row = measure(cfg, params, tp, a.ctx, a.block_size, ring, a.steps, clock, policy, trace)
            row["floor_ms"] = row["pcie_bytes_per_device"] / result[f"links_tp{size}"]["together_per_link_Bps"][
                "median"] * 1e3
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (a.out / "tp_decode.json").write_text(json.dumps(result, indent=1))
        del params
    return 0


if __name__ == "__main__":
    sys.exit(main())
