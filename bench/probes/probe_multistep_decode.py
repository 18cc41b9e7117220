"""Would several decode steps a launch take the host's dispatch off a small batch's decode step? At batch 2 on the
Qwen3-0.6B shape a step's device time is 1.43 ms and its dispatch 2.5 ms more (runs/h200_dispatch/), which is what
keeps the server's time per token and first token off their targets (issue 62), and the 128K sketch step is its
host's dispatch too (issue 63, runs/h200_batch_of_one/).

The batch engine's decode step (`serving/model_runner._decode_step`, greedy draws) on the Qwen3-0.6B shape, random
bf16 weights, BATCH (2) sequences at PROMPT (512) tokens in the engine's paged pool, STEPS (8) steps:
- `one_per_launch`: as the engine runs a step: its packed inputs moved, the tokens fed from the previous draw on the
  device, the model, the draw, each launched, no wait between steps;
- `looped`: one program whose `fori_loop` runs the same STEPS steps (the same model and draw functions).
Per step: the host's dispatch and the wall time until the last draw is ready (median of REPEATS loops, min-max), the
GPU span of the STEPS steps (`gpu_span_ms`), and whether both give the same tokens. Run it also with
`XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE`, so that XLA's CUDA graphs may take the loop (the profiler then
may see the graph's launch rather than its kernels: compare wall times there, not GPU spans).

    python bench/probes/probe_multistep_decode.py        # writes probe_multistep_decode.json under $OUT
"""
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import gpu_span_ms, model_config, probe_output, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM  # noqa: E402
from jax_offload.precision import step_jit  # noqa: E402
from jax_offload.serving import model_runner as mr  # noqa: E402
from jax_offload.serving.model_runner import Draws  # noqa: E402

BATCH, PROMPT = int(os.environ.get("BATCH", 2)), int(os.environ.get("PROMPT", 512))
STEPS, REPEATS = int(os.environ.get("STEPS", 8)), int(os.environ.get("REPEATS", 5))
SHAPE = os.environ.get("SHAPE", "qwen3-0.6b")
LAYERS = int(os.environ["LAYERS"]) if os.environ.get("LAYERS") else None  # fewer layers: a quick CPU check


@functools.partial(step_jit, static_argnums=(0, 1, 2), static_argnames=("tp",), donate_argnums=(4, 5))
def looped_steps(cfg, impl, steps, params, k_pool, v_pool, inv_freq, first_tokens, packed_steps, tp=None):
    """STEPS decode steps in one program: step i takes packed_steps[i] and step i - 1's draw."""
    def step(i, carry):
        tokens, k_pool, v_pool, drawn = carry
        packed = packed_steps[i]
        # The plain functions under the jit: a nested jit may not carry the step's compiler options.
        logits, k_pool, v_pool = mr._decode_step.__wrapped__(cfg, impl, params, k_pool, v_pool, inv_freq, tokens,
                                                             packed, tp=tp)
        tokens = mr._sample_step.__wrapped__(logits, packed, Draws("greedy")).tokens
        return tokens, k_pool, v_pool, drawn.at[i].set(tokens)

    drawn = jnp.zeros((steps, first_tokens.shape[0]), jnp.int32)
    _, k_pool, v_pool, drawn = jax.lax.fori_loop(0, steps, step, (first_tokens, k_pool, v_pool, drawn))
    return drawn, k_pool, v_pool


def main():
    cfg = model_config(SHAPE, LAYERS)
    llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", max_model_len=PROMPT + 64,
                          max_num_seqs=BATCH)
    runner = llm._batch().runner  # the batch engine's, as a server's steps run
    size = runner.batch_size(BATCH)
    blocks = -(-(PROMPT + STEPS) // runner.block_size)
    packed_steps = np.zeros((STEPS, size, mr.STEP_COLUMNS + runner.max_blocks_per_seq), np.int32)
    knobs, _ = mr.sampling_batch([], size)  # greedy rows
    for i in range(STEPS):
        packed_steps[i, :, mr._PREVIOUS_ROW] = np.arange(size) if i else -1
        packed_steps[i, :, mr._KNOBS] = knobs
        for row in range(BATCH):
            packed_steps[i, row, mr._TOKEN] = 7 + row
            packed_steps[i, row, mr._SEQ_LEN] = PROMPT + i + 1
            packed_steps[i, row, mr.STEP_COLUMNS:mr.STEP_COLUMNS + blocks] = np.arange(row * blocks, (row + 1) * blocks)
    placed = runner.tp.sharding(None)
    args = (runner.cfg, runner.impl)

    def one_per_launch():
        tokens, drawn = mr.device_rows(size, placed), []
        for i in range(STEPS):
            packed = jax.device_put(packed_steps[i], placed)
            tokens = mr.feed_step_tokens(tokens, packed)
            logits, runner.k_pool, runner.v_pool = mr._decode_step(
                *args, runner.params, runner.k_pool, runner.v_pool, runner.inv_freq, tokens, packed, tp=runner.tp)
            tokens = mr._sample_step(logits, packed, Draws("greedy")).tokens
            drawn.append(tokens)
        return drawn

    def looped():
        first = mr.feed_step_tokens(mr.device_rows(size, placed), jax.device_put(packed_steps[0], placed))
        drawn, runner.k_pool, runner.v_pool = looped_steps(
            *args, STEPS, runner.params, runner.k_pool, runner.v_pool, runner.inv_freq, first,
            jax.device_put(packed_steps, placed), tp=runner.tp)
        return drawn

    result = {"meta": run_metadata(), "shape": SHAPE, "layers": cfg.num_layers, "batch": BATCH, "prompt": PROMPT,
              "steps": STEPS, "xla_flags": os.environ.get("XLA_FLAGS", ""), "ms_per_step": {}}
    tokens = {}
    for name, run in (("one_per_launch", one_per_launch), ("looped", looped)):
        tokens[name] = np.asarray(jax.block_until_ready(run()))[:, :BATCH].tolist()  # compiled, then timed
        dispatch, wall = [], []
        for _ in range(REPEATS):
            start = time.perf_counter()
            out = run()
            dispatched = time.perf_counter()
            jax.block_until_ready(out)
            dispatch.append((dispatched - start) * 1e3 / STEPS)
            wall.append((time.perf_counter() - start) * 1e3 / STEPS)
        row = {"host_dispatch": stats(dispatch), "wall": stats(wall)}
        if jax.default_backend() == "gpu":
            row["gpu_span"] = stats([s / STEPS for s in gpu_span_ms(run, 5)])
        result["ms_per_step"][name] = row
        print(name, json.dumps(row), flush=True)
    result["same_tokens"] = tokens["one_per_launch"] == tokens["looped"]
    result["tokens"] = tokens
    print("same tokens:", result["same_tokens"], flush=True)
    probe_output("probe_multistep_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
