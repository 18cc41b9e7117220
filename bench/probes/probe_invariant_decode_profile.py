"""Where a batch-1 decode step's time goes in GPU memory, with and without batch-invariant mode (Llama-3.1-8B shape,
random bf16, a 32K prompt or --ctx): one generate of 16 tokens after a warm-up, recorded with jax.profiler.trace; for decode
steps 2..16 the GPU time per step by kernel (names with their digits dropped) and the union of busy GPU time; with
--prefill-runs N, then N prefills of the prompt timed (one token each, median with min-max).

    python bench/probes/probe_invariant_decode_profile.py --batch-invariant --out $OUT   # then --no-batch-invariant
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
p.add_argument("--out", type=Path, required=True)
p.add_argument("--prefill-runs", type=int, default=0, help="then time this many prefills of the prompt (one token)")
a = p.parse_args()

TOKENS = 16
cfg = model_config("llama-3.1-8b")
cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, a.ctx + 64))  # 128K + decode
llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", max_model_len=a.ctx + 64,
                      max_num_batched_tokens=40000, batch_invariant=a.batch_invariant)
prompt = random.Random(1).choices(range(1000), k=a.ctx)
sampling = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
llm.generate(prompt, sampling)
outs = []
data = profiled(lambda: outs.append(llm.generate(prompt, sampling)[0]))
steps = [s * 1e3 for s in outs[0].decode_token_seconds]
result = {"meta": run_metadata(), "batch_invariant": a.batch_invariant, "ctx": a.ctx, "decode_step_ms": steps,
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
