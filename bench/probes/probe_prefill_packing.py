"""Probe: tokens a prefill computes on nano-vllm's workload, prompts packed into one row (the batch engine's
prefill) against each prompt padded to the longest of its step (the engine's earlier prefill).

The workload of bench/bench_throughput.py (256 prompts of 100..1024 tokens, seed 0) goes through the batch
engine's scheduler with the H200 run's pool (2304 blocks of 256 tokens), 256 running requests and a budget of
16384 tokens per prefill step, each way of counting a step's tokens; no model runs. Prints the JSON it writes
to probe_prefill_packing.json under $OUT when set (kept in bench/results/runs/cpu_prefill_packing/).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_throughput import workload  # noqa: E402
from common import run_metadata  # noqa: E402
from jax_offload.buckets import prompt_bucket  # noqa: E402
from jax_offload.sampling import SamplingParams  # noqa: E402
from jax_offload.serving.block_manager import BlockManager  # noqa: E402
from jax_offload.serving.model_runner import batch_buckets, packed_length, prefill_bucket  # noqa: E402
from jax_offload.serving.scheduler import Scheduler  # noqa: E402
from jax_offload.serving.sequence import Sequence  # noqa: E402

MAX_NUM_SEQS, BUDGET, NUM_BLOCKS, BLOCK_SIZE = 256, 16384, 2304, 256


def padded(lengths: list[int]) -> int:
    """The earlier runner: rows padded to a power-of-two count, each to the bucket of the longest prompt."""
    rows = next(b for b in batch_buckets(MAX_NUM_SEQS) if b >= len(lengths))
    return rows * max(prompt_bucket(max(lengths)), 64)


def packed(lengths: list[int]) -> int:
    return prefill_bucket(sum(packed_length(n) for n in lengths))


class _NoSwap:
    """The scheduler's KV swapper; never called here (the pool holds every prompt)."""

    def can_swap_out(self, seq) -> bool:
        return True

    def swap_out(self, seq) -> None:
        pass

    def swap_in(self, seq) -> None:
        pass

    def drop(self, seq) -> None:
        pass


def prefill_steps(prompts: list[list[int]], max_tokens: list[int], count) -> dict:
    scheduler = Scheduler(BlockManager(NUM_BLOCKS, BLOCK_SIZE), _NoSwap(), MAX_NUM_SEQS, BUDGET, count)
    for i, (ids, m) in enumerate(zip(prompts, max_tokens)):
        scheduler.add(Sequence(i, ids, SamplingParams(max_tokens=m), np.zeros(2, np.uint32), len(ids) + m))
    steps = []
    while scheduler.waiting:  # every prompt fits the pool, so all are prefilled before any decode step
        step = scheduler.schedule()
        steps.append(count([s.num_tokens for s in step.seqs]))
    return {"prefill_steps": len(steps), "tokens_computed": sum(steps), "tokens_per_step": steps}


def main() -> None:
    prompts, max_tokens = workload(SimpleNamespace(shape="qwen3-0.6b", num_seqs=256))
    result = {"input_tokens": sum(map(len, prompts)), "packed": prefill_steps(prompts, max_tokens, packed),
              "padded": prefill_steps(prompts, max_tokens, padded), "meta": run_metadata()}
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_prefill_packing.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
