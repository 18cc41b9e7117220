"""Probe: does a request's bfloat16 output depend on how the engine ran it? Greedy 64 tokens for 16 prompts of
mixed lengths: each alone (in GPU memory, the batch engine with one request), all together (continuous batching,
prompts past max_num_batched_tokens in chunk steps shared with the others' decodes), and offloaded one at a time
(a block size that is a multiple of the decode split), and all together again after their first halves were cached
by earlier requests (prefix caching), with the engine's batch-invariant mode and,
with `--modes invariant,default`, without it.

Model: the Llama-3.1-8B shape with random bf16 weights (prompts of 100..20K random tokens, block 4096), or with
`--model DIR` a real model (SmolLM2's 8,192 positions: 100..8,100 tokens, block 1024).

  python bench/probes/probe_path_invariance.py --out probe_path_invariance.json [--model DIR] [--modes invariant]
  python bench/probes/probe_path_invariance.py --out tp2.json --tp 2      # two GPUs: alone against together
  python bench/probes/probe_path_invariance.py --out steps.json --num-decode-steps 4   # + 4 decode steps a program
  python bench/probes/probe_path_invariance.py --out cached.json --modes invariant --legs cached   # one leg a call
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import model_config, random_params, run_metadata  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload.config import ModelConfig  # noqa: E402
from jax_offload.tensor_parallel import TensorParallel  # noqa: E402

SHAPE_LENGTHS = [100, 517, 1030, 2222, 4100, 8000, 12001, 20000, 333, 777, 1500, 3000, 5555, 6000, 9999, 16000]
REAL_LENGTHS = [100, 517, 1030, 2222, 4100, 8000, 6001, 8100, 333, 777, 1500, 3000, 5555, 6000, 7001, 7600]
TOKENS = 64


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(got: list[list[int]], alone: list[list[int]]) -> dict:
    return {"identical": sum(a == b for a, b in zip(got, alone)), "of": len(alone),
            "first_divergence": [first_diff(a, b) for a, b in zip(got, alone)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: the 8B shape, random)")
    p.add_argument("--modes", default="invariant,default", help="invariant, default, or both (comma-separated)")
    p.add_argument("--layers", type=int, help="the 8B shape with this many layers (a faster check of the same kernels)")
    p.add_argument("--prompts", type=int, default=16, help="the first N of the 16 prompt lengths")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (the 8B shape): alone against together only")
    p.add_argument("--num-decode-steps", type=int, default=1,
                   help="N > 1: also each alone and all together with N decode steps a program, against alone")
    p.add_argument("--legs", default="together,offloaded,cached",
                   help="what to compare against alone (comma-separated: together, offloaded, cached); a subset fits "
                        "a shorter device call")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    legs = {leg.strip() for leg in args.legs.split(",") if leg.strip()}
    if not legs or legs - {"together", "offloaded", "cached"}:
        raise SystemExit(f"--legs {args.legs!r}: give together, offloaded and/or cached")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"invariant", "default"}:
        raise SystemExit(f"--modes {args.modes!r}: give invariant, default or both")

    if args.model is None:
        cfg = model_config("llama-3.1-8b", args.layers)
        tp = TensorParallel.create(args.tp) if args.tp > 1 else None
        params = random_params(cfg, jnp.bfloat16, seed=3, tp=tp)
        lengths, block, max_len, vocab = SHAPE_LENGTHS, 4096, 32768, cfg.vocab_size
        make = lambda **kw: LLM.from_params(cfg, params, max_model_len=max_len,  # noqa: E731
                                            tensor_parallel_size=args.tp, **kw)
        model = f"llama-3.1-8b random bf16 seed 3, {cfg.num_layers} layers, TP={args.tp}"
    else:
        lengths, block, max_len = REAL_LENGTHS, 1024, 8192
        make = lambda **kw: LLM(args.model, dtype="bfloat16", max_model_len=max_len, **kw)  # noqa: E731
        vocab = ModelConfig.from_hf(args.model).vocab_size
        model = f"{args.model.name} bf16"
    rng = np.random.default_rng(77)
    lengths = lengths[: args.prompts]
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in lengths]
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out = {"meta": run_metadata() | {"hopper_attention": os.environ.get("JAX_OFFLOAD_HOPPER_ATTENTION", "1")},
           "model": model, "lengths": lengths, "tokens": TOKENS, "offload_block": block}

    start = time.perf_counter()

    def leg(result: dict, name: str, got: list[list[int]], alone: list[list[int]]) -> None:
        """Records a comparison as it comes (a run cut short by a time limit keeps the legs it finished)."""
        result[name] = compare(got, alone)
        print(f"{time.perf_counter() - start:.0f} s", mode, name, result[name]["identical"], "of", len(alone),
              flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out | {"batch_invariant" if mode == "invariant" else "not_invariant": result},
                                       indent=1))

    for mode in modes:
        invariant = mode == "invariant"
        gpu = make(gpu_memory_utilization=0.5, batch_invariant=invariant)
        alone = [list(gpu.generate([q], sp)[0].token_ids) for q in prompts]
        result = {}
        print(f"{time.perf_counter() - start:.0f} s", mode, "alone", flush=True)
        if "together" in legs:
            leg(result, "together_vs_alone", [list(o.token_ids) for o in gpu.generate(prompts, sp)], alone)
        del gpu
        if args.num_decode_steps > 1:
            n = args.num_decode_steps
            stepped = make(gpu_memory_utilization=0.5, batch_invariant=invariant, num_decode_steps=n)
            leg(result, f"alone_steps{n}_vs_alone", [list(stepped.generate([q], sp)[0].token_ids) for q in prompts],
                alone)
            leg(result, f"together_steps{n}_vs_alone", [list(o.token_ids) for o in stepped.generate(prompts, sp)],
                alone)
            del stepped
        if args.tp == 1 and "offloaded" in legs:
            off = make(offload=True, block_size=block, batch_invariant=invariant)
            offloaded = [list(off.generate([q], sp)[0].token_ids) for q in prompts]
            del off
            leg(result, "offloaded_vs_alone", offloaded, alone)
        if args.tp == 1 and "cached" in legs:
            # The first halves sent first (one token each, together), so that the prompts' full blocks up to their
            # middles are cached; then the prompts together, their first halves read from the prefix cache.
            cached = make(gpu_memory_utilization=0.5, batch_invariant=invariant, enable_prefix_caching=True)
            cached.generate([q[: len(q) // 2] for q in prompts],
                            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            outs = cached.generate(prompts, sp)
            result["cached_prompt_tokens"] = [o.num_cached_tokens for o in outs]
            leg(result, "cached_halves_together_vs_alone", [list(o.token_ids) for o in outs], alone)
            del cached
        out["batch_invariant" if invariant else "not_invariant"] = result
        print(mode, json.dumps(result), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
