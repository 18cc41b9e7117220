"""The host's time to dispatch one compiled program on the GPU: a tiny elementwise program, the same donating a
1 GiB buffer, and the batch engine's prefill program over one layer (`_prefill_layers`, Qwen3-0.6B shape, a
1024-token row) and decode step (batch 2), each with the same buffers on every call and with new input buffers
(as the engine calls them). Run under different XLA_FLAGS to see what a launch costs (e.g. command buffers off).
Then the decode step with new inputs under jax.profiler.trace: its GPU kernels and busy time per step, and the
host's traced events by name (`decode_step_profile`); and the step with every argument and result at a fixed
address (`decode_step_stable_*`: does XLA's CUDA graph still need an update on each launch?).

    python bench/probes/probe_dispatch.py --out DIR --tag NAME   # DIR/dispatch_NAME.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_serve import build_llm  # noqa: E402
from common import run_metadata  # noqa: E402


def per_call_ms(call, reps: int = 200) -> dict:
    """Mean host time per call over `reps` back-to-back calls (no wait between), and the time until all are done."""
    import jax

    out = call()
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(reps):
        out = call()
    dispatched = time.perf_counter()
    jax.block_until_ready(out)
    done = time.perf_counter()
    return {"dispatch_ms": (dispatched - start) / reps * 1e3, "done_ms": (done - start) / reps * 1e3}


def profile(call, steps: int) -> dict:
    """`steps` calls in a row under the profiler: GPU kernels and their busy time (union over streams) per step, the
    wall time per step, and the host's traced events (XLA's, and Python's, marked $) by name: count and total ms
    (nested events each count their own time), the 30 largest."""
    import jax

    from common import busy_ns, gpu_kernels, host_events, profiled

    jax.block_until_ready(call())
    times = {}

    def run():
        start = time.perf_counter()
        out = [call() for _ in range(steps)]
        jax.block_until_ready(out)
        times["wall"] = time.perf_counter() - start

    data = profiled(run)
    kernels = sorted(gpu_kernels(data), key=lambda e: e[1])
    busy = busy_ns(kernels)
    return {"steps": steps, "wall_ms_per_step": times["wall"] / steps * 1e3,
            "gpu_kernels_per_step": len(kernels) / steps, "gpu_busy_ms_per_step": busy / 1e6 / steps,
            "host_events": host_events(data)}


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_offload.serving import model_runner as mr

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--shape", default="qwen3-0.6b")
    args = p.parse_args()
    result = {"meta": run_metadata(), "xla_flags": os.environ.get("XLA_FLAGS", "")}

    small = jnp.ones(8)
    tiny = jax.jit(lambda a: a * 2 + 1)
    result["tiny"] = per_call_ms(lambda: tiny(small))

    state = {"big": jnp.zeros(1 << 28)}  # 1 GiB of float32
    donate = jax.jit(lambda a: a.at[0].add(1), donate_argnums=0)

    def donating():
        state["big"] = donate(state["big"])
        return state["big"]

    result["donating_1gib"] = per_call_ms(donating)

    llm = build_llm(args.shape, 4096)
    runner = llm.request_engine().runner
    length = 1024
    x = jnp.zeros((1, length, runner.cfg.hidden_size), runner.params.embed.dtype)
    positions = jnp.asarray(np.arange(length, dtype=np.int32)[None])
    starts = jnp.zeros((1, length), jnp.int32)
    slots = jnp.full((1, length), -1, jnp.int32)
    layer = runner.params.layers[0]
    pools = {"k": runner.k_pool[0], "v": runner.v_pool[0]}

    def prefill_layer():
        out, (pools["k"],), (pools["v"],) = mr._prefill_layers(runner.cfg, runner.impl, (layer,), x, (pools["k"],),
                                                               (pools["v"],), runner.inv_freq, positions, starts,
                                                               slots, tp=runner.tp)
        return out

    result["prefill_layer_1024"] = per_call_ms(prefill_layer, 100)

    # The same with its input in a new buffer on every call, as each layer group takes the one before's output: if
    # the launch then costs more, it is the command buffers' update for new addresses (x + 0: a small program of
    # its own, timed in the call).
    def prefill_layer_new_input():
        out, (pools["k"],), (pools["v"],) = mr._prefill_layers(runner.cfg, runner.impl, (layer,), x + 0,
                                                               (pools["k"],), (pools["v"],), runner.inv_freq,
                                                               positions, starts, slots, tp=runner.tp)
        return out

    result["prefill_layer_1024_new_input"] = per_call_ms(prefill_layer_new_input, 100)
    runner.k_pool = (pools["k"], *runner.k_pool[1:])
    runner.v_pool = (pools["v"], *runner.v_pool[1:])

    size = 2
    tokens = jnp.zeros(size, jnp.int32)
    # The step's packed inputs (`mr.decode_step_inputs`): two rows of 600 tokens over blocks 0..63.
    packed_host = np.zeros((size, mr.STEP_COLUMNS + 64), np.int32)
    packed_host[:, mr._SEQ_LEN] = 600
    packed_host[:, mr.STEP_COLUMNS:] = np.arange(64, dtype=np.int32)
    packed = jnp.asarray(packed_host)

    def decode_step():
        logits, runner.k_pool, runner.v_pool = mr._decode_step(runner.cfg, runner.impl, runner.params, runner.k_pool,
                                                               runner.v_pool, runner.inv_freq, tokens, packed,
                                                               tp=runner.tp)
        return logits

    result["decode_step_batch2"] = per_call_ms(decode_step, 100)

    # The same step with its small inputs in new buffers on every call, as the engine's steps take them: if the
    # launch then costs more, it is the command buffers' update for new addresses.
    host = (np.zeros(size, np.int32), packed_host)

    def decode_step_new_inputs():
        new_tokens, new_packed = jax.device_put(host)
        logits, runner.k_pool, runner.v_pool = mr._decode_step(runner.cfg, runner.impl, runner.params, runner.k_pool,
                                                               runner.v_pool, runner.inv_freq, new_tokens, new_packed,
                                                               tp=runner.tp)
        return logits

    result["decode_step_batch2_new_inputs"] = per_call_ms(decode_step_new_inputs, 100)
    result["decode_step_profile"] = profile(decode_step_new_inputs, 20)

    # The same step with every buffer it touches at a fixed address: the logits written into a donated buffer of
    # their shape, the small inputs written in place into donated buffers by a program of their own. If XLA's
    # command buffer (CUDA graph) then needs no update, the launch costs less.
    import functools

    from jax_offload.precision import step_jit

    @functools.partial(step_jit, static_argnums=(0, 1), static_argnames=("tp",), donate_argnums=(3, 4, 8))
    def stable_step(cfg, impl, params, k_pool, v_pool, inv_freq, tokens, packed, logits_buffer, tp=None):
        del logits_buffer  # its buffer takes the logits (same shape and dtype)
        return mr._decode_step.__wrapped__(cfg, impl, params, k_pool, v_pool, inv_freq, tokens, packed, tp=tp)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill(buffers, values):
        return jax.tree.map(lambda b, v: b.at[...].set(v), buffers, values)

    held = {"logits": jnp.zeros((size, runner.cfg.vocab_size), jnp.float32),
            "inputs": jax.device_put(host)}

    def decode_step_stable(new_inputs: bool):
        if new_inputs:
            held["inputs"] = fill(held["inputs"], jax.device_put(host))
        held["logits"], runner.k_pool, runner.v_pool = stable_step(
            runner.cfg, runner.impl, runner.params, runner.k_pool, runner.v_pool, runner.inv_freq, *held["inputs"],
            held["logits"], tp=runner.tp)
        return held["logits"]

    result["decode_step_stable_buffers"] = per_call_ms(lambda: decode_step_stable(False), 100)
    result["decode_step_stable_filled_inputs"] = per_call_ms(lambda: decode_step_stable(True), 100)
    result["decode_step_stable_profile"] = profile(lambda: decode_step_stable(True), 20)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dispatch_{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(args.tag, json.dumps({k: v for k, v in result.items() if k != "meta"}))


if __name__ == "__main__":
    main()
