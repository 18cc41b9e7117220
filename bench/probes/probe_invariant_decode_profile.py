"""Where a decode step's time goes in GPU memory, with and without batch-invariant mode (--shape, default the
Llama-3.1-8B shape, random bf16; --batch prompts of --ctx tokens each, default one of 32K): one generate of 16 tokens
after a warm-up, recorded with jax.profiler.trace; for decode steps 2..16 the GPU time per step by kernel (names with
their digits dropped) and the union of busy GPU time; with --prefill-runs N (batch 1), then N prefills of the prompt
timed (one token each, median with min-max).

    python bench/probes/probe_invariant_decode_profile.py --batch-invariant --out $OUT   # then --no-batch-invariant
    python bench/probes/probe_invariant_decode_profile.py --shape qwen3-0.6b --batch 256 --ctx 600 ...  # a workload's step
"""
import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax.numpy as jnp  # noqa: E402

from common import decode_steps_by_kernel, model_config, profiled, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, required=True)
p.add_argument("--ctx", type=int, default=32768)
p.add_argument("--shape", default="llama-3.1-8b")
p.add_argument("--batch", type=int, default=1, help="prompts decoded together (distinct, --ctx tokens each)")
p.add_argument("--out", type=Path, required=True)
p.add_argument("--prefill-runs", type=int, default=0, help="then time this many prefills of the prompt (one token)")
a = p.parse_args()

TOKENS = 16
if a.prefill_runs and a.batch > 1:
    p.error(f"--prefill-runs times one prompt's prefill; --batch is {a.batch}")
cfg = model_config(a.shape)
cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, a.ctx + 64))  # 128K + decode
llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", max_model_len=a.ctx + 64,
                      max_num_batched_tokens=max(40000, a.ctx), max_num_seqs=max(a.batch, 256),
                      batch_invariant=a.batch_invariant)
rng = random.Random(1)
prompts = [rng.choices(range(1000), k=a.ctx) for _ in range(a.batch)]
prompt = prompts[0]
sampling = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
llm.generate(prompts, sampling)
outs = []
data = profiled(lambda: outs.append(llm.generate(prompts, sampling)[0]))
steps = [s * 1e3 for s in outs[0].decode_token_seconds]  # the batch's steps: every request takes one token each
result = {"meta": run_metadata(), "shape": a.shape, "batch": a.batch, "batch_invariant": a.batch_invariant,
          "ctx": a.ctx, "decode_step_ms": steps,
          **decode_steps_by_kernel(data, steps)}
if a.prefill_runs:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    result["prefill_s"] = stats([llm.generate(prompt, one)[0].prefill_seconds for _ in range(a.prefill_runs)])
a.out.mkdir(parents=True, exist_ok=True)
name = "invariant" if a.batch_invariant else "default"
(a.out / f"profile_{name}.json").write_text(json.dumps(result, indent=1))
print(name, "steps ms", [round(s, 2) for s in steps], "busy", round(result["gpu_busy_ms_per_step"], 3),
      "prefill s", result.get("prefill_s"))
for k, v in list(result["per_kernel_ms_per_step"].items())[:18]:
    print(f"{v['ms_per_step']:8.3f} ms {v['count_per_step']:7.1f}x  {k}")
