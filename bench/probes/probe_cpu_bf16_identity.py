"""Issue 26's CPU point at its full size, too long for the suite (tests/test_batch_invariance.py runs a part of it):
tiny Llama, Qwen2 and Qwen3 (built by tests/tiny_models.py) in bfloat16 on the CPU, 10 prompts of 5..700 tokens,
60 tokens each, greedy and seeded, each prompt's tokens alone against
  together   all 10 on the batch engine for every max_num_seqs 1..10
  chunked    all 10 with a 256-token step budget: the long prompts prefill in chunks whose steps also decode the
             running requests (mixed steps)
  offloaded  block 256 and 512, chunked and layerwise prefill, one at a time and all together
Writes one JSON: per model, sampling and path, how many of the 10 prompts gave the alone tokens bit for bit.

    python bench/probes/probe_cpu_bf16_identity.py \
        --out bench/results/runs/cpu_bf16_identity/probe_cpu_bf16_identity.cpu.json

Results: `bench/results/runs/cpu_bf16_identity/`. A first run, before the XLA paged twin attended one sequence at a
time (8de9114), found tiny Qwen3 greedy at 9 of 10 together for max_num_seqs 5..10 and in chunks.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from common import run_metadata  # noqa: E402

LENGTHS = (5, 700, 37, 260, 12, 530, 90, 400, 150, 64)
MODEL_SEED, PROMPT_SEED = 4201, 4202


def check(variant: str, folder: Path) -> dict:
    import numpy as np

    import tiny_models
    from jax_offload import LLM, SamplingParams
    from jax_offload.serving.engine import BatchEngine

    path = folder / variant
    tiny_models.build(variant, path, seed=MODEL_SEED)
    rng = np.random.default_rng(PROMPT_SEED)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in LENGTHS]
    samplings = {"greedy": SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                 "seeded": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, ignore_eos=True, seed=7)}
    llm = LLM(path, dtype="bfloat16", max_model_len=1024)
    out = {}
    for name, sampling in samplings.items():
        t = time.perf_counter()
        alone = [llm.generate([p], sampling)[0].token_ids for p in prompts]

        def same(outputs) -> int:
            return sum(o.token_ids == a for o, a in zip(outputs, alone))

        def engine(max_num_seqs: int, budget: int = 16384) -> BatchEngine:
            # One pool shape for every limit: the engines share their compiled steps.
            return BatchEngine.in_gpu(llm.model_config, llm.params, llm._inv_freq, llm.dtype, llm.attention_impl,
                                      llm.max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      num_blocks=40)

        row = {"together": {m: same(engine(m).generate(prompts, sampling)) for m in range(1, 11)}}
        chunked = engine(10, budget=256)
        row["chunked_budget_256"] = same(chunked.generate(prompts, sampling))
        row["mixed_steps"] = sum(kind == "chunk" and n > 1 for kind, n, *_ in chunked.step_log)
        for block in (256, 512):
            for prefill in ("chunked", "layerwise"):
                off = LLM(path, dtype="bfloat16", max_model_len=1024, offload=True, block_size=block,
                          prefill=prefill)
                row[f"offloaded_{block}_{prefill}_alone"] = sum(
                    off.generate([p], sampling)[0].token_ids == a for p, a in zip(prompts, alone))
                row[f"offloaded_{block}_{prefill}_together"] = same(off.generate(prompts, sampling))
        row["seconds"] = time.perf_counter() - t
        out[name] = row
        print(variant, name, json.dumps(row), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3,qwen2,qwen3")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    result = {"meta": run_metadata() | {"lengths": LENGTHS, "model_seed": MODEL_SEED, "prompt_seed": PROMPT_SEED},
              "prompts": len(LENGTHS)}
    with tempfile.TemporaryDirectory() as folder:
        for variant in a.models.split(","):
            result[variant] = check(variant, Path(folder))
            a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
