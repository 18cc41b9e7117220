"""Where an in-GPU decode step's time goes under tensor parallelism (issue 30): TP=1 against TP=2 at 8K.

Llama-3.1-8B shape, random bf16 weights, one --ctx prompt on the batch engine (KV in GPU memory), greedy. Per TP
size: the per-token decode times of --runs generations of --tokens tokens (after one warm-up), one more generation
under JAX's profiler (summarised per track: each device's busy ms against the span, the longest kernels), and the
latency of the step's collective alone: --layers x 2 all-reduces of one token's hidden state [1, hidden] bf16 in one
program, as the decode step has them.

    python bench/probes/probe_tp_in_gpu.py --tp 1 --out $OUT/in_gpu; python ... --tp 2 --out $OUT/in_gpu
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import call_seconds, model_config, random_params, run_metadata, stats  # noqa: E402


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


def all_reduce_latency(tp, hidden: int, count: int) -> dict:
    """ms of one program doing `count` dependent all-reduces of [1, hidden] bf16 per device, and per all-reduce."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def chain(x):
        def body(_, y):
            return jax.lax.psum(y, "tp") * jnp.asarray(0.5, y.dtype)
        return jax.lax.fori_loop(0, count, body, x)

    fn = jax.jit(jax.shard_map(chain, mesh=tp.mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = jax.device_put(jnp.ones((tp.size, hidden), jnp.bfloat16), tp.sharding(0))
    seconds = call_seconds(lambda: fn(x), 20)
    s = stats([t * 1e3 for t in seconds])
    return {"count": count, "program_ms": s, "per_all_reduce_us": s["median"] * 1e3 / count}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tag", default="", help="suffix of the output names (a variant's XLA_FLAGS, say)")
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    import jax
    import numpy as np

    from jax_offload import LLM, SamplingParams
    from jax_offload.tensor_parallel import TensorParallel

    a.out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(a.shape)
    tp = TensorParallel.create(a.tp)
    result = {"meta": run_metadata() | {"devices": jax.device_count(), "shape": a.shape, "tp": a.tp, "ctx": a.ctx,
                                        "tokens": a.tokens, "max_num_seqs": a.max_num_seqs}}
    if a.tp > 1:
        result["all_reduce"] = all_reduce_latency(tp, cfg.hidden_size, 2 * cfg.num_layers)
        print(json.dumps(result["all_reduce"]), flush=True)
    params = random_params(cfg, jax.numpy.bfloat16, tp=tp)
    llm = LLM.from_params(cfg, params, dtype="bfloat16", tensor_parallel_size=a.tp,
                          max_model_len=a.ctx + a.tokens + 16, max_num_seqs=a.max_num_seqs)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=a.ctx).tolist()
    sampling = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate([ids], sampling)
    steps, walls = [], []
    for _ in range(a.runs):
        t = time.perf_counter()
        out = llm.generate([ids], sampling)[0]
        walls.append(time.perf_counter() - t)
        steps += [s * 1e3 for s in out.decode_token_seconds]
    result["decode_ms"] = stats(steps)
    result["decode_steps_ms"] = [round(s, 3) for s in steps]
    result["generate_s"] = stats(walls)
    engine = llm._batch()
    result["overlapped_steps"] = engine.overlapped_steps
    result["pool_blocks"] = engine.runner.num_blocks
    print(json.dumps({k: result[k] for k in ("decode_ms", "generate_s", "overlapped_steps", "pool_blocks")}),
          flush=True)
    name = f"in_gpu_tp{a.tp}{'_' + a.tag if a.tag else ''}"
    result["meta"]["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    if not a.no_trace:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        folder = a.out / f"trace_{name}"
        with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        found = sorted(folder.rglob("perfetto_trace.json.gz"))
        if found:
            kept = a.out / f"trace_{name}.json.gz"
            shutil.copy(found[-1], kept)
            result["trace_summary"] = summarise_trace(kept)
        shutil.rmtree(folder, ignore_errors=True)
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
