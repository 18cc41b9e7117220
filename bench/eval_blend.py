"""KV reuse quality on the real model: the multi-document QA set (`jax_offload.eval.multidoc_qa`), answered with
full prefill, with every document's KV reused as computed alone (ratio 0), and with CacheBlend at each
--ratios. Each config is one engine whose segment store starts empty, so a document's first question computes it
alone and later questions (other orders, other company) reuse it. Writes <out>/blend_<config>.json (every
question's output, exact match, F1, prefill seconds, reused tokens) and <out>/blend_qa.md.

    python bench/eval_blend.py --model DIR --out bench/results/runs/cpu_blend_qa
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_metadata  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from jax_offload import LLM, SamplingParams, Segments
    from jax_offload.default_model import default_model_dir
    from jax_offload.eval.multidoc_qa import exact_match, f1, make_qa_set

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--ratios", default="0.05,0.15,0.3")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    model = a.model or default_model_dir()
    a.out.mkdir(parents=True, exist_ok=True)
    _, questions = make_qa_set(AutoTokenizer.from_pretrained(model), num_questions=a.questions)
    sampling = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    configs = {"full": None, "reuse": 0.0, **{f"blend{r}": float(r) for r in a.ratios.split(",")}}
    rows, full_outputs = [], None
    for name, ratio in configs.items():
        options = dict(dtype=a.dtype, max_model_len=4096)
        if ratio is not None:
            options.update(enable_prefix_caching=True, prefix_cache_host_gb=2.0, blend_recompute_ratio=ratio)
        llm = LLM(model, **options)
        records = []
        for q in tqdm(questions, desc=name, unit="question", leave=False):
            ids = [t for part in q.parts for t in part]
            out = llm.generate(Segments(q.parts) if ratio is not None else [ids], sampling)[0]
            records.append({"index": q.index, "docs": q.docs, "answer": q.answer, "output": out.text,
                            "exact_match": exact_match(out.text, q.answer), "f1": f1(out.text, q.answer),
                            "prompt_tokens": len(ids), "num_cached_tokens": out.num_cached_tokens,
                            "prefill_seconds": out.prefill_seconds})
        outputs = [r["output"] for r in records]
        full_outputs = full_outputs or outputs
        row = {"config": name, "ratio": ratio, "questions": len(records),
               "exact_match": 100 * float(np.mean([r["exact_match"] for r in records])),
               "f1": 100 * float(np.mean([r["f1"] for r in records])),
               "outputs_equal_full": sum(o == f for o, f in zip(outputs, full_outputs)),
               "reused_token_share": float(sum(r["num_cached_tokens"] for r in records)
                                           / sum(r["prompt_tokens"] for r in records))}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / f"blend_{name}.json").write_text(json.dumps({**run_metadata(), **row, "options": options,
                                                               "records": records}, indent=1))
    lines = ["| config | exact match | F1 | outputs = full's | prompt tokens reused |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['exact_match']:.1f} | {r['f1']:.1f} | {r['outputs_equal_full']}/{r['questions']} "
              f"| {100 * r['reused_token_share']:.0f}% |" for r in rows]
    (a.out / "blend_qa.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
