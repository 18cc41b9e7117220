"""Where a served prompt's prefill time goes on the Qwen3-0.6B shape (random bf16 weights, the serving benchmark's
engine): the host's dispatch of the batch engine's prefill as it runs (`engine_prefill`: a program per group of
layers, `buckets.layer_group_size`; a program per layer until eeb3eea, the `layer_programs` of older result files)
against its time until the draw is on the host, whether its donated KV pools are taken in place, the same prefill as
one program over every layer, the one-request path's time to first token, and a decode step at batch 2.

    python bench/probes/probe_prefill_host.py --out DIR      # one device call; writes DIR/prefill_host.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_serve import build_llm  # noqa: E402
from common import run_metadata  # noqa: E402


def summary(xs: list[float]) -> dict:
    ms = [x * 1e3 for x in xs]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def main() -> None:
    import jax
    import numpy as np

    from jax_offload import SamplingParams
    from jax_offload.attention import embed_tokens
    from jax_offload.serving import model_runner as mr

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompt-len", type=int, default=560)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shape", default="qwen3-0.6b", help="smoke: a CPU check of the script")
    args = p.parse_args()
    llm = build_llm(args.shape, 4096)
    engine = llm.request_engine()
    runner = engine.runner
    rng = np.random.default_rng(0)
    vocab = min(10000, llm.model_config.vocab_size)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(4 * args.reps + 8)]
    one = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=0)
    for prompt in prompts[:3]:
        engine.generate([prompt], [one])

    records, donated = [], []
    dispatch_prefill = runner.prefill_async

    def timed(seqs):
        old = jax.tree.leaves(runner.k_pool[0])[0]
        start = time.perf_counter()
        drawn = dispatch_prefill(seqs)
        dispatched = time.perf_counter()
        drawn.tokens.block_until_ready()
        records.append((dispatched - start, time.perf_counter() - start))
        donated.append(bool(old.is_deleted()))
        return drawn

    captured = []

    def timed_sampling(seqs):
        captured.append(seqs)
        return timed(seqs)

    runner.prefill_async = timed_sampling
    for prompt in prompts[3:3 + args.reps]:
        engine.generate([prompt], [one])
    runner.prefill_async = dispatch_prefill

    # The draw alone (last rows' logits and the sampler over the padded 256 rows), on a prefill's hidden shape.
    size = runner.buckets[-1]
    hidden = jax.numpy.zeros((1, runner.prefill_tokens([args.prompt_len]), runner.cfg.hidden_size),
                             runner.params.embed.dtype)
    last = np.zeros(size, np.int32)
    sampling_times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        mr.sample_last(runner.cfg, runner.params, hidden, last, *runner._sampling(captured[-1], size)
                       ).tokens.block_until_ready()
        sampling_times.append(time.perf_counter() - start)

    # The same layers as one program (all 28 unrolled), timed the same way.
    layer_fn = mr._prefill_layer.__wrapped__

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def whole(layers, x, k_pool, v_pool, inv_freq, positions, starts, slots):
        ks, vs = [], []
        for layer, k, v in zip(layers, k_pool, v_pool):
            x, k, v = layer_fn(runner.cfg, runner.impl, layer, x, k, v, inv_freq, positions, starts, slots,
                               tp=runner.tp)
            ks.append(k)
            vs.append(v)
        return x, tuple(ks), tuple(vs)

    whole_times = []

    def whole_prefill(seqs):
        size = runner.buckets[-1]
        start = time.perf_counter()
        ids, positions, starts, slots, rows = runner._packed_inputs(seqs, [s.num_tokens for s in seqs])
        last = np.zeros(size, np.int32)
        last[: len(rows)] = rows
        x = embed_tokens(runner.params.embed, ids)
        x, k_pool, v_pool = whole(runner.params.layers, x, runner.k_pool, runner.v_pool, runner.inv_freq, positions,
                                  starts, slots)
        runner.k_pool, runner.v_pool = k_pool, v_pool
        drawn = mr.sample_last(runner.cfg, runner.params, x, last, *runner._sampling(seqs, size))
        dispatched = time.perf_counter()
        drawn.tokens.block_until_ready()
        whole_times.append((dispatched - start, time.perf_counter() - start))
        return drawn

    runner.prefill_async = whole_prefill
    t = time.perf_counter()
    engine.generate([prompts[3]], [one])
    whole_compile_s = time.perf_counter() - t
    whole_times.clear()
    for prompt in prompts[3 + args.reps:3 + 2 * args.reps]:
        engine.generate([prompt], [one])
    runner.prefill_async = dispatch_prefill

    # The one-request path (LLM.generate of one prompt): the serving benchmark's offline time to first token.
    for prompt in prompts[:2]:
        llm.generate([prompt], one)
    single = []
    for prompt in prompts[3 + 2 * args.reps:3 + 3 * args.reps]:
        t = time.perf_counter()
        llm.generate([prompt], one)
        single.append(time.perf_counter() - t)

    # A decode step at batch 2: the host's dispatch against the step log's step time.
    decode_dispatch = []
    dispatch_decode = runner.decode_async

    def timed_decode(seqs, previous=None):
        start = time.perf_counter()
        drawn = dispatch_decode(seqs, previous)
        decode_dispatch.append(time.perf_counter() - start)
        return drawn

    two = [SamplingParams(temperature=0.6, max_tokens=200, ignore_eos=True, seed=i) for i in range(2)]
    engine.generate(prompts[:2], two)
    runner.decode_async = timed_decode
    engine.generate(prompts[4:6], two)
    steps = [s for kind, _, _, s in engine.step_log if kind == "decode"]
    runner.decode_async = dispatch_decode

    result = {"meta": run_metadata(), "shape": args.shape, "prompt_len": args.prompt_len,
              "engine_prefill": {"dispatch": summary([a for a, _ in records]),
                                 "until_drawn": summary([b for _, b in records]),
                                 "pool_donated_in_place": all(donated)},
              "one_program": {"compile_s": whole_compile_s, "dispatch": summary([a for a, _ in whole_times]),
                              "until_drawn": summary([b for _, b in whole_times])},
              "draw_only": summary(sampling_times[1:]),
              "one_request_path_ttft": summary(single),
              "decode_batch2": {"dispatch": summary(decode_dispatch), "step": summary(steps)}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_host.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
