"""Real default model, RULER-style prompts of ~4K tokens: offloaded greedy output must equal in-GPU output.

    python bench/offload_equivalence.py --out bench/results/offload_equivalence.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_metadata  # noqa: E402  (also puts the repository root on sys.path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples-per-task", type=int, default=2)
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--ring-slots", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    from jax_offload import LLM, SamplingParams
    from jax_offload.default_model import ensure_default_model
    from jax_offload.eval.ruler import make_samples, score_string_match_all

    model_dir = ensure_default_model(quiet=True)
    in_gpu = LLM(model_dir, dtype="float32")
    offload = {
        mode: LLM(model_dir, dtype="float32", offload=True, block_size=args.block_size,
                  num_ring_slots=args.ring_slots, prefill=mode)
        for mode in ("chunked", "layerwise")
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for task in args.tasks.split(","):
        for s in make_samples(task, in_gpu.tokenizer, args.length, args.samples_per_task, seed=0):
            t = time.perf_counter()
            ref = in_gpu.generate([s.prompt_ids], greedy)[0]
            row = dict(task=task, index=s.index, prompt_tokens=len(s.prompt_ids), answers=s.answers,
                       in_gpu_text=ref.text, in_gpu_ids=ref.token_ids,
                       in_gpu_score=score_string_match_all([ref.text], [s.answers]))
            for mode, llm in offload.items():
                out = llm.generate([s.prompt_ids], greedy)[0]
                row[f"offload_{mode}_ids"] = out.token_ids
                row[f"offload_{mode}_identical"] = out.token_ids == ref.token_ids
            row["seconds"] = time.perf_counter() - t
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_ids")}), flush=True)
    summary = dict(
        model=model_dir.name, **run_metadata(), length=args.length, block_size=args.block_size, ring_slots=args.ring_slots, prompts=len(rows),
        identical_chunked=sum(r["offload_chunked_identical"] for r in rows),
        identical_layerwise=sum(r["offload_layerwise_identical"] for r in rows),
        in_gpu_mean_score=sum(r["in_gpu_score"] for r in rows) / len(rows),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(summary=summary, rows=rows), indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
