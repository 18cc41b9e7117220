"""Time to first token of a prompt made of cached documents: CacheBlend (`Segments`) against full prefill, one GPU,
Llama-3.1-8B shape, random bf16 weights, KV in GPU memory.

--docs documents of --doc-tokens random tokens each and a --question-tokens question: a warm-up request keeps
every document's KV in the host tier (and compiles); then each timed run asks a new question over the documents
in a new order, with CacheBlend at each of --ratios, and the same token ids with full prefill. TTFT is the wall time
of `generate(..., max_tokens=1)`; medians of --repeats runs with min and max, each path warmed up first.

    python bench/bench_blend.py --out $OUT/blend
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import gpu_memory, model_config, random_params, run_metadata, stats  # noqa: E402


def main() -> None:
    import jax.numpy as jnp
    import numpy as np

    from jax_offload import LLM, SamplingParams, Segments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--num-layers", type=int, help="fewer layers, for a smoke run")
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--ratios", default="0.15,0")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(a.shape, a.num_layers)
    params = random_params(cfg, jnp.bfloat16)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.vocab_size, a.doc_tokens).tolist() for _ in range(a.docs)]
    total = a.docs * a.doc_tokens + a.question_tokens
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt():
        order = rng.permutation(a.docs)
        return [docs[i] for i in order] + [rng.integers(0, cfg.vocab_size, a.question_tokens).tolist()]

    def ttft(llm, request) -> float:
        start = time.perf_counter()
        llm.generate(request, one)
        return time.perf_counter() - start

    doc_bytes = a.docs * a.doc_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    rows = {}
    for ratio in [float(r) for r in a.ratios.split(",")]:
        llm = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=total + 16, enable_prefix_caching=True,
                              prefix_cache_host_gb=doc_bytes / 2**30 + 1, blend_recompute_ratio=ratio,
                              gpu_memory_utilization=0.5)
        ttft(llm, Segments(prompt()))  # keeps the documents, compiles
        ttft(llm, Segments(prompt()))  # the reuse path's own shapes
        seconds = [ttft(llm, Segments(prompt())) for _ in range(a.repeats)]
        rows[f"blend{ratio}"] = {"ttft_s": stats(seconds), "gpu_memory": gpu_memory()}
        print(json.dumps({f"blend{ratio}": rows[f"blend{ratio}"]}), flush=True)
        del llm
    llm = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=total + 16, gpu_memory_utilization=0.5)
    ttft(llm, [[t for part in prompt() for t in part]])
    rows["full"] = {"ttft_s": stats([ttft(llm, [[t for part in prompt() for t in part]]) for _ in range(a.repeats)]),
                    "gpu_memory": gpu_memory()}
    print(json.dumps({"full": rows["full"]}), flush=True)
    ratios = {k: v["ttft_s"]["median"] / rows["full"]["ttft_s"]["median"] for k, v in rows.items() if k != "full"}
    (a.out / "blend_ttft.json").write_text(json.dumps({**run_metadata(), "args": {k: str(v) for k, v in vars(a).items()},
                                                       "rows": rows, "over_full": ratios}, indent=1))
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
