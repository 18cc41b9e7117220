"""Where do several decode steps a program pay, as the batch engine runs them offline? The server on the Qwen3-0.6B
shape gained from 4 steps a program (its step at 1 request/s 1.80 ms against 2.63, runs/h200_serve/ file 11), while
a warm-up that timed 4 programs of 4 steps against 16 single steps offline kept them at no batch size on either shape
(files 12 and 3). This measures what that warm-up measured, with real prompt lengths and more tokens, at each batch
size: `BatchEngine.generate` of BATCH prompts of --prompt random tokens, --tokens sampled tokens each (temperature
0.6, ignore_eos), with single steps and with --steps steps a program, the same engine and compiled programs,
alternating, --repeats runs each after a warm-up run of each. Per batch size: the engine's decode seconds per decode
step from its own step log (as `bench_serve.py` reports them) and the wall time of the call, medians (min-max), the
ratio several / single, and whether both gave the same tokens. Also, for single steps, the host's dispatch of a step
(until `decode_async` returns) as the engine runs them, and a step's time when each is waited for before the next
(dispatch, then the device: the device's share is the difference), medians over a run's steps: whether a batch
size's step is host-bound, the rule an automatic N might use.

    python bench/probes/probe_multistep_engine.py --shape qwen3-0.6b --out DIR   # DIR/multistep_engine_SHAPE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import model_config, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402


def single_step_parts(engine, run) -> tuple[float, float]:
    """Medians over a run's single decode steps, ms: the host's time in `decode_async` as the engine calls it, and
    with every step waited for before the next is scheduled, its time from the call until its draw is ready."""
    import jax

    decode_async = engine.runner.decode_async
    times: list[float] = []

    def timed(wait: bool):
        def call(seqs, previous=None, *rest):
            start = time.perf_counter()
            drawn = decode_async(seqs, previous, *rest)
            if wait:
                jax.block_until_ready(drawn.tokens)
            times.append((time.perf_counter() - start) * 1e3)
            return drawn
        return call

    parts = []
    for wait in (False, True):
        times.clear()
        engine.runner.decode_async = timed(wait)
        try:
            run()
        finally:
            engine.runner.decode_async = decode_async
        parts.append(statistics.median(times))
    return parts[0], parts[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, help="fewer layers: a quick CPU check")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,256")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=65, help="tokens a request draws (the first one in its prefill)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = model_config(args.shape, args.layers)
    llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16",
                          max_model_len=args.prompt + args.tokens + 1, max_num_seqs=max(batches),
                          num_decode_steps=args.steps)
    engine = llm.request_engine()
    rng = np.random.default_rng(0)
    result = {"meta": run_metadata(), "shape": args.shape, "layers": cfg.num_layers, "prompt": args.prompt,
              "tokens": args.tokens, "steps": args.steps, "repeats": args.repeats, "batches": {}}
    out = args.out / f"multistep_engine_{args.shape}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    for size in batches:
        prompts = [rng.integers(0, 10000, size=args.prompt).tolist() for _ in range(size)]
        params = [SamplingParams(temperature=0.6, seed=i, max_tokens=args.tokens, ignore_eos=True)
                  for i in range(size)]

        def run(steps: int) -> tuple[float, float, int, list[list[int]]]:
            engine.num_decode_steps = steps
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            wall = time.perf_counter() - start
            decode = [s for kind, _, _, s in engine.step_log if kind == "decode"]
            return sum(decode) / len(decode), wall, len(decode), [list(o.token_ids) for o in outs]

        tokens = {n: run(n)[3] for n in (1, args.steps)}  # compiles, warms
        dispatch_ms, serial_ms = single_step_parts(engine, lambda: run(1))
        timed: dict[int, list[tuple[float, float, int]]] = {1: [], args.steps: []}
        for _ in range(args.repeats):
            for n in timed:
                timed[n].append(run(n)[:3])
        row = {}
        for n, runs in timed.items():
            row[f"steps{n}"] = {"decode_step_ms": stats([r[0] * 1e3 for r in runs]),
                                "wall_s": stats([r[1] for r in runs]), "decode_steps": runs[0][2]}
        several, single = row[f"steps{args.steps}"], row["steps1"]
        row["ratio_decode_step"] = several["decode_step_ms"]["median"] / single["decode_step_ms"]["median"]
        row["ratio_wall"] = several["wall_s"]["median"] / single["wall_s"]["median"]
        row["same_tokens"] = tokens[1] == tokens[args.steps]
        row["single_step_host_dispatch_ms"] = dispatch_ms
        row["single_step_waited_ms"] = serial_ms
        row["single_step_device_ms_est"] = serial_ms - dispatch_ms
        result["batches"][str(size)] = row
        print(size, json.dumps({k: row[k] for k in ("ratio_decode_step", "ratio_wall", "same_tokens")}),
              f"single {single['decode_step_ms']['median']:.3f} ms", flush=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
