"""The host's time to dispatch one compiled program on the GPU: a tiny elementwise program, the same donating a
1 GiB buffer, and the batch engine's prefill program over one layer (`_prefill_layers`, Qwen3-0.6B shape, a
1024-token row) and decode step (batch 2), each with the same buffers on every call and with new input buffers
(as the engine calls them). Run under different XLA_FLAGS to see what a launch costs (e.g. command buffers off).

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
    seq_lens = jnp.asarray(np.array([600, 600], np.int32))
    tables = jnp.asarray(np.tile(np.arange(64, dtype=np.int32), (size, 1)))

    def decode_step():
        logits, runner.k_pool, runner.v_pool = mr._decode_step(runner.cfg, runner.impl, runner.params, runner.k_pool,
                                                               runner.v_pool, runner.inv_freq, tokens, seq_lens,
                                                               tables, tp=runner.tp)
        return logits

    result["decode_step_batch2"] = per_call_ms(decode_step, 100)

    # The same step with its small inputs in new buffers on every call, as the engine's steps take them: if the
    # launch then costs more, it is the command buffers' update for new addresses.
    host = (np.zeros(size, np.int32), np.array([600, 600], np.int32),
            np.tile(np.arange(64, dtype=np.int32), (size, 1)))

    def decode_step_new_inputs():
        new_tokens, new_lens, new_tables = jax.device_put(host)
        logits, runner.k_pool, runner.v_pool = mr._decode_step(runner.cfg, runner.impl, runner.params, runner.k_pool,
                                                               runner.v_pool, runner.inv_freq, new_tokens, new_lens,
                                                               new_tables, tp=runner.tp)
        return logits

    result["decode_step_batch2_new_inputs"] = per_call_ms(decode_step_new_inputs, 100)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dispatch_{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(args.tag, json.dumps({k: v for k, v in result.items() if k != "meta"}))


if __name__ == "__main__":
    main()
