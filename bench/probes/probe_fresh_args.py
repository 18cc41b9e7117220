"""Which arguments of an offloaded sketch decode step's programs come at a new device address each step (issue 63)?

The in-GPU decode step's CUDA graph was updated before every launch because its input buffers were new each step
(runs/h200_dispatch/README.md, "Why the graph is updated"); at 128K the offloaded sketch step is the host's dispatch
(runs/h200_batch_of_one/, 47th session), ~0.5 ms of each sparse program's launch in `command_buffer::update` (46th
session's trace). This lists, per program the batch engine's offloaded step calls (`embed_tokens`, `_step_rows`,
`pooled_stored_decode_layers`, `pooled_pages_decode_layers`, `sample_last`), the array arguments whose buffer
address changed between consecutive steps (each call compared with the same call of the next step: `name#i`), by
parameter name, over the steady steps of one request (the first 3 steps left out), and likewise its results (`out`
and their path). Random weights, SHAPE (qwen3-0.6b) with LAYERS layers (6), a CTX-token prompt (4096), block BLOCK
(512), RING ring slots (4), sketch decode (budget BUDGET tokens, default CTX/8; page 16, 2 dense layers, int4
sketch) with a page cache of CACHE_GB (0.05), MAX_SEQS (2) sequences at most, TOKENS new tokens (12), DTYPE
(float32; bfloat16 on a GPU). The 128K step of `probe_batch_of_one.py`: `SHAPE=llama-3.1-8b LAYERS=32 CTX=131072
BLOCK=4096 RING=16 BUDGET=4096 CACHE_GB=2 MAX_SEQS=1 DTYPE=bfloat16`. On the CPU a `device_put` of a NumPy array may
alias host memory, so arguments moved from the host each step can keep an address there that they would not keep
on a GPU. Writes probe_fresh_args.json under $OUT.

    python bench/probes/probe_fresh_args.py
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_offload.serving.offload_model_runner as offload_model_runner  # noqa: E402
from common import model_config, probe_output, random_params, run_metadata  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402

SHAPE, LAYERS = os.environ.get("SHAPE", "qwen3-0.6b"), int(os.environ.get("LAYERS", 6))
CTX, BLOCK, TOKENS = int(os.environ.get("CTX", 4096)), int(os.environ.get("BLOCK", 512)), int(os.environ.get("TOKENS", 12))
DTYPE, RING = os.environ.get("DTYPE", "float32"), int(os.environ.get("RING", 4))
BUDGET, CACHE_GB = int(os.environ.get("BUDGET", CTX // 8)), float(os.environ.get("CACHE_GB", 0.05))
MAX_SEQS = int(os.environ.get("MAX_SEQS", 2))
PROGRAMS = ("embed_tokens", "_step_rows", "pooled_stored_decode_layers", "pooled_pages_decode_layers", "sample_last")


def main() -> None:
    cfg = model_config(SHAPE, LAYERS)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, CTX + 4 * BLOCK))
    llm = LLM.from_params(cfg, random_params(cfg, jnp.dtype(DTYPE)), dtype=DTYPE, offload=True, block_size=BLOCK,
                          num_ring_slots=RING, max_model_len=CTX + TOKENS + BLOCK, max_num_seqs=MAX_SEQS,
                          decode_policy="sketch", decode_budget=BUDGET, page_size=16, dense_layers=2,
                          sketch_dtype="int4", sparse_cache_gb=CACHE_GB)
    # Per program and its place in the step (a step runs each sparse layer group's program once: `name#i`, the i-th
    # call since the step's `_step_rows`), each call's arrays, so a group is compared with itself a step later.
    calls: dict[str, list[list[tuple[str, int]]]] = collections.defaultdict(list)
    in_step: collections.Counter = collections.Counter()

    def recorded(name: str):
        fn = getattr(offload_model_runner, name)
        names = list(inspect.signature(getattr(fn, "__wrapped__", fn)).parameters)

        def call(*args, **kwargs):
            leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
            addresses = [(_argument(path, names), x.unsafe_buffer_pointer()) for path, x in leaves
                         if isinstance(x, jax.Array)]
            out = fn(*args, **kwargs)
            addresses += [("out" + jax.tree_util.keystr(path), x.unsafe_buffer_pointer())
                          for path, x in jax.tree_util.tree_flatten_with_path(out)[0] if isinstance(x, jax.Array)]
            if name == "_step_rows":
                in_step.clear()
            calls[f"{name}#{in_step[name]}"].append(addresses)
            in_step[name] += 1
            return out
        return call

    for name in PROGRAMS:
        setattr(offload_model_runner, name, recorded(name))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=CTX).tolist()
    llm.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    programs = {}
    for name, steps in calls.items():
        steady = steps[3:]
        moved = collections.Counter()
        for before, after in zip(steady, steady[1:]):
            for (argument, a), (_, b) in zip(before, after):
                moved[argument] += a != b
        programs[name] = {"calls": len(steps), "arrays_in_and_out": len(steps[0]),
                          "moved": {argument: f"{count}/{len(steady) - 1}" for argument, count in moved.items()
                                    if count}}
        print(name, programs[name], flush=True)
    result = {**run_metadata(), "shape": SHAPE, "layers": LAYERS, "ctx": CTX, "block": BLOCK, "ring": RING,
              "budget": BUDGET, "sparse_cache_gb": CACHE_GB, "max_num_seqs": MAX_SEQS, "tokens": TOKENS,
              "dtype": DTYPE, "programs": programs}
    probe_output("probe_fresh_args.json").write_text(json.dumps(result, indent=1))


def _argument(path, names: list[str]) -> str:
    """A leaf's name: its parameter's (positional index mapped to the signature), then the rest of its path."""
    head, *rest = path[1:]  # path[0] picks args or kwargs
    name = names[head.idx] if hasattr(head, "idx") and head.idx < len(names) else jax.tree_util.keystr((head,))
    return name + jax.tree_util.keystr(tuple(rest))


if __name__ == "__main__":
    main()
