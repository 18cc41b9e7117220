"""On the GPU, bf16: does offloaded decode give the in-GPU engine's tokens, step for step?

Random weights at the SmolLM2-135M shape (nearly flat logits, so any rounding difference in a layer flips a
greedy token soon), prompts of 4096 random ids, 32 greedy tokens; the in-GPU engine against offloaded engines
with block sizes that are multiples of DECODE_SPLIT (the decode splits align: same bits expected) and one that
is not (correct, not bitwise). Prints a table and writes decode_bits.json under --out.

    python bench/probes/probe_decode_bits.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import run_metadata  # noqa: E402  (also puts the repository root on sys.path)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--shape", default="smollm2-135m")
    a = p.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from common import model_config, random_params
    from jax_offload import LLM, SamplingParams

    cfg = model_config(a.shape)
    params = random_params(cfg, jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    engines = {"in_gpu": {}}
    for block in (256, 1024, 320):
        for prefill in ("chunked", "layerwise"):
            engines[f"offload block {block} {prefill}"] = dict(offload=True, block_size=block, num_ring_slots=2,
                                                               prefill=prefill)
    outputs = {}
    for name, options in engines.items():
        llm = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=a.prompt_len + a.tokens, **options)
        # One prompt per call: several prompts in GPU memory would go to the batch engine.
        outputs[name] = [llm.generate([ids], greedy)[0].token_ids for ids in prompts]
        del llm
    rows = []
    for name, outs in outputs.items():
        same = sum(o == r for o, r in zip(outs, outputs["in_gpu"]))
        first = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), None) for o, r in zip(outs, outputs["in_gpu"])]
        rows.append(dict(engine=name, identical=same, prompts=len(outs), first_difference=first))
        print(f"{name:32s} identical to in-GPU {same}/{len(outs)}  first differing token {first}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode_bits.json").write_text(json.dumps(dict(rows=rows, meta=run_metadata(), tokens=outputs), indent=1))


if __name__ == "__main__":
    main()
