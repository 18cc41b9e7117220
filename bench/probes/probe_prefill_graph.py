"""Does XLA update a served prompt's prefill programs' CUDA graphs before each launch, as it did the decode step's
before its inputs had slots (runs/h200_dispatch/README.md, "Why the graph is updated")? A prefill's programs take
new inputs each prompt (ids, positions, key starts, pool slots) and pass new activations from one group of layers to
the next. On the Llama-3.1-8B shape the server's time to first token at 1 request/s missed its limit by 0.8 ms with a
7.5-ms "waiting" part (runs/h200_serve/ file 3).

The batch engine's prefill of a --prompt-len prompt (the serving benchmark's engine, random bf16 weights), two ways:
`alone`, the engine idle (`BatchEngine.generate` of the one prompt); `behind`, one request decoding while a new
prompt is added every --every steps, so the engine dispatches its prefill behind the decode step in flight
(`BatchEngine._prefill_behind`), as a server does. Per way: the host's dispatch of `prefill_async` (until it
returns), median (min-max) over --reps prompts; under the profiler, --profile-reps more prompts: the host's
command-buffer events (update, launch) in all and per prefill. The decode steps' own launches no longer update, so
in `behind` the updates are the prefills'.

    python bench/probes/probe_prefill_graph.py --shape llama-3.1-8b --out DIR   # DIR/prefill_graph_SHAPE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from bench_serve import build_llm  # noqa: E402
from common import host_events, profiled, run_metadata  # noqa: E402


def main() -> None:
    import numpy as np

    from jax_offload import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--prompt-len", type=int, default=560)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile-reps", type=int, default=5)
    p.add_argument("--every", type=int, default=8, help="decode steps between two prompts added (`behind`)")
    p.add_argument("--layers", type=int, help="fewer layers: a CPU check")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    llm = build_llm(args.shape, 4096, num_layers=args.layers)
    engine = llm.request_engine()
    runner = engine.runner
    rng = np.random.default_rng(0)
    vocab = min(10000, llm.model_config.vocab_size)
    one = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=0)

    def prompt() -> list[int]:
        return rng.integers(0, vocab, args.prompt_len).tolist()

    dispatches: list[float] = []
    prefill_async = runner.prefill_async

    def timed(seqs):
        start = time.perf_counter()
        drawn = prefill_async(seqs)
        dispatches.append(time.perf_counter() - start)
        return drawn

    def alone(n: int) -> None:
        for _ in range(n):
            engine.generate([prompt()], [one])

    def behind(n: int) -> None:
        decode = SamplingParams(temperature=0.6, max_tokens=(n + 1) * args.every, ignore_eos=True, seed=1)
        engine.add_request("decode", prompt(), decode)
        steps = added = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if added < n and steps % args.every == 0:
                engine.add_request(f"prompt-{added}", prompt(), one)
                added += 1

    runner.prefill_async = timed
    result = {"meta": run_metadata(), "shape": args.shape, "prompt_len": args.prompt_len, "reps": args.reps,
              "profile_reps": args.profile_reps, "every": args.every, "ways": {}}
    for name, way in (("alone", alone), ("behind", behind)):
        way(3)  # compiles, warms
        dispatches.clear()
        behind_before = engine.prefills_behind
        way(args.reps)
        behind_count = engine.prefills_behind - behind_before
        ms = [d * 1e3 for d in (dispatches[1:] if name == "behind" else dispatches)]  # behind: not the decoder's own
        events = host_events(profiled(lambda way=way: way(args.profile_reps)), top=300)
        graph = {k: v for k, v in events.items() if "command_buffer" in k or "cuGraph" in k}
        update = graph.get("command_buffer::update", {"count": 0, "total_ms": 0.0})
        result["ways"][name] = {
            "prefill_dispatch_ms": {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)},
            "graph_update_ms_per_prefill": update["total_ms"] / args.profile_reps,
            "graph_updates_per_prefill": update["count"] / args.profile_reps, "graph_events": graph,
            "prefills_dispatched_behind_a_decode": behind_count}
        print(name, json.dumps(result["ways"][name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"prefill_graph_{args.shape}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
