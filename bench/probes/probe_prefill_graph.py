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
in `behind` the updates are the prefills'. `slotted_alone` and `slotted_behind` run the same with the decode step's
remedy applied to the prefill, here in the probe: its inputs written into slots per packed length, the embedding
into a slot, and the activations donated from one group of layers to the next (so every program of a length reads
and writes the same buffers); `same_tokens`: greedy prompts give the engine's tokens that way too.

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
    import functools

    import jax
    import numpy as np

    from jax_offload import SamplingParams
    from jax_offload.attention import embed_tokens
    from jax_offload.precision import step_jit
    from jax_offload.serving import model_runner as mr

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

    def timed(seqs, prefill):
        start = time.perf_counter()
        drawn = prefill(seqs)
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

    # The remedy, in the probe: slots per packed length (ids, positions, key starts, pool slots, activations).
    @functools.partial(jax.jit, donate_argnums=(0,))
    def stage(held, new):
        return tuple(h.at[:].set(n) for h, n in zip(held, new))

    @functools.partial(step_jit, donate_argnums=(0,))
    def embed_into(x_slot, table, ids):  # the plain function under the jit: a nested one may not carry options
        return x_slot.at[:].set(embed_tokens.__wrapped__(table, ids))

    layers_donating_x = functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",),
                                          donate_argnums=(3, 4, 5))(mr._prefill_layers.__wrapped__)
    held_by_length: dict[int, tuple] = {}
    addresses: dict[int, set[int]] = {}  # each length's slots' device addresses seen: 5 if they never moved

    def slotted_prefill_async(seqs):
        size = runner.buckets[-1]
        ids, positions, starts, slots, rows = runner._packed_inputs(seqs, [seq.num_tokens for seq in seqs])
        last = np.zeros(size, np.int32)
        last[: len(rows)] = rows
        length = ids.shape[1]
        held = held_by_length.pop(length, None) or (
            *jax.device_put((np.zeros_like(ids), np.zeros_like(positions), np.zeros_like(starts),
                             np.zeros_like(slots))),
            jax.numpy.zeros((1, length, runner.cfg.hidden_size), runner.params.embed.dtype))
        inputs = stage(held[:4], jax.device_put((ids, positions, starts, slots)))
        x = embed_into(held[4], runner.params.embed, inputs[0])
        layers, group = tuple(runner.params.layers), mr.layer_group_size(len(runner.params.layers))
        k_out, v_out = (), ()
        for i in range(0, len(layers), group):
            x, k_pools, v_pools = layers_donating_x(runner.cfg, runner.impl, layers[i:i + group], x,
                                                    runner.k_pool[i:i + group], runner.v_pool[i:i + group],
                                                    runner.inv_freq, *inputs[1:], tp=runner.tp)
            k_out, v_out = k_out + k_pools, v_out + v_pools
        runner.k_pool, runner.v_pool = k_out, v_out
        held_by_length[length] = (*inputs, x)
        addresses.setdefault(length, set()).update(a.unsafe_buffer_pointer() for a in held_by_length[length])
        return mr.sample_last(runner.cfg, runner.params, x, last, *runner._sampling(seqs, size))

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    checked = [prompt() for _ in range(3)]
    engine_tokens = [o.token_ids for o in engine.generate(checked, greedy)]
    runner.prefill_async = slotted_prefill_async
    same_tokens = [o.token_ids for o in engine.generate(checked, greedy)] == engine_tokens

    result = {"meta": run_metadata(), "shape": args.shape, "prompt_len": args.prompt_len, "reps": args.reps,
              "profile_reps": args.profile_reps, "every": args.every, "same_tokens": same_tokens, "ways": {}}
    for name, way in (("alone", alone), ("behind", behind), ("slotted_alone", alone), ("slotted_behind", behind)):
        prefill = slotted_prefill_async if name.startswith("slotted") else prefill_async
        runner.prefill_async = lambda seqs, prefill=prefill: timed(seqs, prefill)
        way(3)  # compiles, warms
        dispatches.clear()
        behind_before = engine.prefills_behind
        way(args.reps)
        behind_count = engine.prefills_behind - behind_before
        ms = [d * 1e3 for d in (dispatches[1:] if name.endswith("behind") else dispatches)]  # behind: not the decoder's own
        events = host_events(profiled(lambda way=way: way(args.profile_reps)), top=300)
        graph = {k: v for k, v in events.items() if "command_buffer" in k or "cuGraph" in k}
        update = graph.get("command_buffer::update", {"count": 0, "total_ms": 0.0})
        result["ways"][name] = {
            "prefill_dispatch_ms": {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)},
            "graph_update_ms_per_prefill": update["total_ms"] / args.profile_reps,
            "graph_updates_per_prefill": update["count"] / args.profile_reps, "graph_events": graph,
            "prefills_dispatched_behind_a_decode": behind_count}
        print(name, json.dumps(result["ways"][name]), flush=True)
    runner.prefill_async = prefill_async
    result["slot_addresses_per_length"] = {length: len(seen) for length, seen in addresses.items()}
    print("same tokens", same_tokens, "slot addresses per length (5: none moved)", result["slot_addresses_per_length"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"prefill_graph_{args.shape}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
