"""Does XLA update the decode step's CUDA graph because the step before still holds its temporary buffer? On the
H200, Qwen3-0.6B shape at batch 1, a decode step waited for before the next spent 1.31 ms in its dispatch
(runs/h200_dispatch/multistep/warm_up_choice_c201f83.json); launched while the step before still runs, 1.91-2.17 ms
(runs/h200_dispatch/), of which 1.10 ms was `command_buffer::update` (2.42 - 1.10 = 1.32). A guess: a step's
temporary buffer is freed only once the step is done, so the next step, launched before that, gets another address
and the graph is updated; waited for, it gets the same one. If so, two executables of the same step, used in turn,
would each find their own address again (the step two before is done when the engine launches the next).

The batch engine's decode step (batch 2, 600-token rows, new small inputs each step as the engine makes them), 100
steps in each of three ways: each waited for before the next; launched as the engine does (the next dispatched, then
the one before it read); and the same with two executables in turn. Per way: the host's dispatch time per step and the
wall time per step (medians over the steps), and under the profiler (20 steps) the host's events of XLA's command
buffers and CUDA graphs (their update and launch) and executions, by name.

    python bench/probes/probe_graph_update.py --out DIR   # DIR/graph_update_SHAPE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from bench_serve import build_llm  # noqa: E402
from common import host_events, profiled, run_metadata  # noqa: E402


def main() -> None:
    import functools

    import jax
    import numpy as np

    from jax_offload.precision import step_jit
    from jax_offload.serving import model_runner as mr

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--ways", default="waited,run_ahead,alternating,stable_in,stable_all")
    p.add_argument("--layers", type=int, help="fewer layers: a CPU check (bf16 on the CPU: seconds a step)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    runner = build_llm(args.shape, 4096, num_layers=args.layers).request_engine().runner
    # A second executable of the very same step: its own jit, so its own compiled program and CUDA graph.
    twin = functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",),
                             donate_argnums=(3, 4))(mr._decode_step.__wrapped__)

    # Stable addresses: the step's small inputs (and, for "stable_all", its logits) live in slots the step donates
    # and hands back, so each step's graph sees the same buffers; a tiny program copies each step's new inputs in.
    @functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",), donate_argnums=(3, 4, 6, 7, 8))
    def slotted_step(cfg, impl, params, k_pool, v_pool, inv_freq, tokens, packed, logits_slot, tp=None):
        logits, k_pool, v_pool = mr._decode_step.__wrapped__(cfg, impl, params, k_pool, v_pool, inv_freq, tokens,
                                                              packed, tp=tp)
        return logits, k_pool, v_pool, tokens, packed

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def stage(tokens_slot, packed_slot, new_tokens, new_packed):
        return tokens_slot.at[:].set(new_tokens), packed_slot.at[:].set(new_packed)
    packed_host = np.zeros((args.batch, mr.STEP_COLUMNS + 64), np.int32)
    packed_host[:, mr._SEQ_LEN] = 600
    packed_host[:, mr.STEP_COLUMNS:] = np.arange(64, dtype=np.int32)
    host = (np.zeros(args.batch, np.int32), packed_host)

    def launch(step_fn):
        tokens, packed = jax.device_put(host)
        logits, runner.k_pool, runner.v_pool = step_fn(runner.cfg, runner.impl, runner.params, runner.k_pool,
                                                       runner.v_pool, runner.inv_freq, tokens, packed, tp=runner.tp)
        return logits

    slots = {}

    def launch_stable(keep_logits: bool):
        new_tokens, new_packed = jax.device_put(host)
        if not slots:
            slots["io"] = jax.device_put(host)
            slots["logits"] = jax.numpy.zeros((args.batch, runner.cfg.vocab_size), jax.numpy.float32)
        tokens, packed = stage(*slots["io"], new_tokens, new_packed)
        logits, runner.k_pool, runner.v_pool, tokens, packed = slotted_step(
            runner.cfg, runner.impl, runner.params, runner.k_pool, runner.v_pool, runner.inv_freq, tokens, packed,
            slots["logits"] if keep_logits else None, tp=runner.tp)
        drawn = mr._sample_step(logits, packed, mr.Draws("greedy"))
        slots["io"] = tokens, packed
        if keep_logits:
            slots["logits"] = logits
        return drawn.tokens

    def run(way: str, steps: int) -> tuple[list[float], float]:
        """Dispatch seconds of each step, and the wall time of them all."""
        in_flight: deque = deque()
        dispatch = []
        start = time.perf_counter()
        for i in range(steps):
            fn = twin if way == "alternating" and i % 2 else mr._decode_step
            t = time.perf_counter()
            in_flight.append(launch_stable(way == "stable_all") if way.startswith("stable") else launch(fn))
            dispatch.append(time.perf_counter() - t)
            if way == "waited" or len(in_flight) > 1:
                in_flight.popleft().block_until_ready()  # waited: this one; run ahead: the one before
        while in_flight:
            in_flight.popleft().block_until_ready()
        return dispatch, time.perf_counter() - start

    result = {"meta": run_metadata(), "shape": args.shape, "batch": args.batch, "steps": args.steps, "ways": {}}
    for way in args.ways.split(","):
        run(way, 4)  # compiles, warms
        dispatch, wall = run(way, args.steps)
        data = profiled(lambda way=way: run(way, args.profile_steps))
        events = host_events(data, top=200)
        result["ways"][way] = {
            "dispatch_ms": statistics.median(dispatch) * 1e3, "wall_ms_per_step": wall / args.steps * 1e3,
            "profiled_events": {name: e for name, e in events.items()
                                if any(k in name.lower() for k in ("command_buffer", "graph", "execute"))}}
        print(way, json.dumps(result["ways"][way]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"graph_update_{args.shape}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
