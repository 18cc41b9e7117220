"""Probe: where a Quest decode step's GPU time goes, from a profiler trace (8B shape, random bf16 weights).

bench_sparse times a step's parts each on its own; this records a trace of --steps decode steps after the prompt
(--context tokens, block 4096, 4 ring slots, budget 4096, page 16, 2 dense layers) and sums the GPU time of every
kernel by name, so the kernels that cost the most stand out, and the host's traced events the same way (what
the CPU does while it dispatches the step). Prints the 40 most expensive kernels and the 25 longest host events
(total ms per step, calls per step) and the step's wall time; writes probe_quest_profile.json under $OUT when set.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import model_config, random_params, run_metadata  # noqa: E402

from jax_offload import LLM  # noqa: E402
from jax_offload.attention import embed_tokens  # noqa: E402

p = argparse.ArgumentParser()
gpu = jax.default_backend() == "gpu"
p.add_argument("--context", type=int, default=65536 if gpu else 1024)
p.add_argument("--steps", type=int, default=4)
a = p.parse_args()
cfg = model_config("llama-3.1-8b" if gpu else "smoke", None if gpu else 4)
cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, a.context + 8192))
block, budget = (4096, 4096) if gpu else (64, 128)
llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", offload=True, block_size=block,
                      num_ring_slots=4, decode_policy="quest", decode_budget=budget, page_size=16,
                      dense_layers=2, max_model_len=a.context + block)
ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=a.context).tolist()
runner = llm._runner
hidden, _ = llm._prefill(ids, a.context + 2 * a.steps + 2)
token = embed_tokens(llm.params.embed, np.full((1, 1), 7, np.int32))


def steps(first: int, count: int) -> float:
    t = time.perf_counter()
    for i in range(count):
        jax.block_until_ready(runner.decode(token, a.context + first + i))
    return (time.perf_counter() - t) / count


steps(0, 2)  # compiled and warm
trace_dir = tempfile.mkdtemp()
with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    step_seconds = steps(2, a.steps)
runner.finish()
trace = next(Path(trace_dir).rglob("*.trace.json.gz"))
events = json.loads(gzip.open(trace).read())
events = events["traceEvents"] if isinstance(events, dict) else events
names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
         if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
processes = {e.get("pid"): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
total = {side: collections.Counter() for side in ("gpu", "host")}
calls = {side: collections.Counter() for side in ("gpu", "host")}
for e in events:
    if e.get("ph") != "X":
        continue
    where = (processes.get(e.get("pid"), "") + "/" + names.get((e.get("pid"), e.get("tid")), "")).lower()
    side = "gpu" if not gpu or "gpu" in where or "stream" in where else "host"
    total[side][e["name"]] += e.get("dur", 0) / 1e3 / a.steps
    calls[side][e["name"]] += 1 / a.steps


def top(side: str, n: int) -> list[dict]:
    return [{"name": k[:120], "ms_per_step": round(v, 4), "calls_per_step": round(calls[side][k], 2)}
            for k, v in total[side].most_common(n)]


out = run_metadata() | {"context": a.context, "steps": a.steps, "step_ms": step_seconds * 1e3,
                        "gpu_ms_per_step_all_kernels": sum(total["gpu"].values()), "top_kernels": top("gpu", 40),
                        "top_host_events": top("host", 25)}
print(f"step {step_seconds * 1e3:.2f} ms; kernels {sum(total['gpu'].values()):.2f} ms per step")
for side, n in (("gpu", 40), ("host", 25)):
    print(f"-- {side}")
    for row in top(side, n):
        print(f"{row['ms_per_step']:9.3f} ms  {row['calls_per_step']:7.1f}x  {row['name']}")
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_quest_profile.json").write_text(json.dumps(out, indent=1) + "\n")
