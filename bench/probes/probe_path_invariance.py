"""Probe: does a request's bfloat16 output depend on how the engine ran it? Llama-3.1-8B shape, random bf16
weights, greedy 64 tokens, 16 prompts of 100..20K tokens: each alone (in GPU memory, the batch engine with one
request), all together (continuous batching), and offloaded one at a time (block 4096, a multiple of the 256-key
decode split); with the engine's batch-invariant mode (default) and without it.
  PYTHONPATH=. python bench/probes/probe_path_invariance.py   (writes JSON to $PROBE_OUT, or prints it)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import model_config, random_params, run_metadata  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402

cfg = model_config("llama-3.1-8b")
params = random_params(cfg, jnp.bfloat16, seed=3)
rng = np.random.default_rng(77)
lengths = [100, 517, 1030, 2222, 4100, 8000, 12001, 20000, 333, 777, 1500, 3000, 5555, 6000, 9999, 16000]
prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lengths]
sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
out = {"meta": run_metadata(), "shape": "llama-3.1-8b random bf16 seed 3", "lengths": lengths, "tokens": 64}


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(got, alone):
    return {"identical": sum(a == b for a, b in zip(got, alone)), "of": len(alone),
            "first_divergence": [first_diff(a, b) for a, b in zip(got, alone)]}


for invariant in (True, False):
    gpu = LLM.from_params(cfg, params, max_model_len=32768, gpu_memory_utilization=0.5, batch_invariant=invariant)
    alone = [list(gpu.generate([p], sp)[0].token_ids) for p in prompts]
    together = [list(o.token_ids) for o in gpu.generate(prompts, sp)]
    del gpu
    result = {"together_vs_alone": compare(together, alone)}
    if invariant:
        off = LLM.from_params(cfg, params, max_model_len=32768, offload=True, block_size=4096, num_ring_slots=4)
        offloaded = [list(off.generate([p], sp)[0].token_ids) for p in prompts]
        del off
        result["offloaded_vs_alone"] = compare(offloaded, alone)
    out["batch_invariant" if invariant else "not_invariant"] = result
    print(invariant, json.dumps(result), flush=True)
text = json.dumps(out, indent=1)
if os.environ.get("PROBE_OUT"):
    open(os.environ["PROBE_OUT"], "w").write(text)
