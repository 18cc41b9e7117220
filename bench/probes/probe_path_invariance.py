"""Probe: does a request's bfloat16 output depend on how the engine ran it? Llama-3.1-8B shape, random bf16
weights, greedy 32 tokens: each prompt alone (in GPU memory), all prompts together (continuous batching),
and offloaded one at a time (block 4096, a multiple of the 256-key decode split). Run from the project root:
  PYTHONPATH=. python bench/probes/probe_path_invariance.py   (writes JSON to $PROBE_OUT, or prints it)
(`../shared/probes/path_invariance.py`, rerun after chunked prefill: every prompt in GPU memory, alone or not,
now runs on the batch engine, so "alone" is the batch engine with one request.)
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import model_config, random_params  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402

cfg = model_config("llama-3.1-8b")
params = random_params(cfg, jnp.bfloat16, seed=3)
rng = np.random.default_rng(77)
lengths = [100, 517, 1030, 2222, 4100, 8000, 12001, 20000]
prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lengths]
sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
       "shape": "llama-3.1-8b random bf16 seed 3", "lengths": lengths}

gpu = LLM.from_params(cfg, params, max_model_len=32768, gpu_memory_utilization=0.5)
alone = [list(gpu.generate([p], sp)[0].token_ids) for p in prompts]
together = [list(o.token_ids) for o in gpu.generate(prompts, sp)]
del gpu
off = LLM.from_params(cfg, params, max_model_len=32768, offload=True, block_size=4096, num_ring_slots=4)
offloaded = [list(off.generate([p], sp)[0].token_ids) for p in prompts]


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


for name, got in (("together_vs_alone", together), ("offloaded_vs_alone", offloaded)):
    out[name] = {"identical": sum(a == b for a, b in zip(got, alone)), "of": len(prompts),
                 "first_divergence": [first_diff(a, b) for a, b in zip(got, alone)]}
text = json.dumps(out, indent=1)
if os.environ.get("PROBE_OUT"):
    open(os.environ["PROBE_OUT"], "w").write(text)
print(text)
