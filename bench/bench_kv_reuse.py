"""Time to first token when a prompt's KV is reused: CacheBlend (`Segments`) and prefix caching (from the GPU pool,
from its pinned-host tier, and from the offloaded host store), each against full prefill of the same token ids.
One GPU, Llama-3.1-8B shape, random bf16 weights.

Phase `blend`: --docs documents of --doc-tokens random tokens and a --question-tokens question; a warm-up request
keeps every document's KV in the host tier (and compiles); each timed run asks a new question over the documents
in a new order, with CacheBlend at each of --ratios, and the same token ids by full prefill.

Phase `prefix`: a --prefix-tokens prefix (a long system prompt or chat history) and a new --question-tokens
question each run. In GPU memory, over a pool of --pool-prompts prompts' worth of blocks: full prefill (caching
off), the prefix reused from the pool, and the prefix reused from the host tier after an unrelated prompt of the
same length evicted it from the pool (untimed). Offloaded (chunked, --offload-block tokens per block): full
prefill and the prefix reused from the host store.

TTFT is the wall time of `generate(..., max_tokens=1)`; medians of --repeats runs with min and max, each path run
twice first (compiles, and fills its cache).

    python bench/bench_kv_reuse.py --out $OUT/kv_reuse
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

from jax_offload.config import OFFLOAD_DEFAULTS  # noqa: E402

PHASES = ("blend", "prefix")


def _ttft(generate, prompt) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens reused) of one prompt."""
    from jax_offload import SamplingParams

    start = time.perf_counter()
    out = generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    return time.perf_counter() - start, out.num_cached_tokens


def _row(generate, prompts, before=None) -> dict:
    """Two untimed runs, then the timed ones; `before()` runs (untimed) ahead of each."""
    seconds, cached = [], []
    for i, prompt in enumerate(prompts):
        if before is not None:
            before()
        s, c = _ttft(generate, prompt)
        if i >= 2:
            seconds.append(s)
            cached.append(c)
    return {"ttft_s": stats(seconds), "cached_tokens": cached, "gpu_memory": gpu_memory()}


def phase_blend(a, cfg, params, rng) -> dict:
    from jax_offload import LLM, Segments

    docs = [rng.integers(0, cfg.vocab_size, a.doc_tokens).tolist() for _ in range(a.docs)]
    total = a.docs * a.doc_tokens + a.question_tokens
    runs = a.repeats + 2
    prompts = [[docs[i] for i in rng.permutation(a.docs)] + [rng.integers(0, cfg.vocab_size, a.question_tokens).tolist()]
               for _ in range(runs)]
    doc_bytes = a.docs * a.doc_tokens * cfg.kv_bytes_per_token
    rows = {}
    for ratio in [float(r) for r in a.ratios.split(",")]:
        llm = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=total + 16, enable_prefix_caching=True,
                              prefix_cache_host_gb=doc_bytes / 2**30 + 1, blend_recompute_ratio=ratio,
                              gpu_memory_utilization=0.5)
        rows[f"blend{ratio}"] = _row(llm.generate, [Segments(p) for p in prompts])
        print(json.dumps({f"blend{ratio}": rows[f"blend{ratio}"]}), flush=True)
        del llm
    llm = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=total + 16, gpu_memory_utilization=0.5)
    rows["full"] = _row(llm.generate, [[t for part in p for t in part] for p in prompts])
    print(json.dumps({"full": rows["full"]}), flush=True)
    return rows


def phase_prefix(a, cfg, params, rng) -> dict:
    import jax.numpy as jnp

    from jax_offload import LLM, SamplingParams
    from jax_offload.serving.engine import BatchEngine

    runs = a.repeats + 2
    prefix = rng.integers(0, cfg.vocab_size, a.prefix_tokens).tolist()
    prompts = [prefix + rng.integers(0, cfg.vocab_size, a.question_tokens).tolist() for _ in range(runs)]
    length = a.prefix_tokens + a.question_tokens
    llm = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=length + 16)
    block = 256
    num_blocks = int(a.pool_prompts * -(-length // block))

    def engine(caching: bool) -> BatchEngine:
        # A pool of a set size (not a share of the device's memory), so that one unrelated prompt evicts the prefix.
        return BatchEngine.in_gpu(cfg, llm.params, llm._inv_freq, jnp.bfloat16, llm.attention_impl, llm.max_model_len,
                                  block_size=block, num_blocks=num_blocks, max_num_seqs=4,
                                  enable_prefix_caching=caching,
                                  prefix_cache_host_bytes=2 * length * cfg.kv_bytes_per_token if caching else 0)

    rows = {"gpu_full": _row(engine(False).generate, prompts)}
    print(json.dumps({"gpu_full": rows["gpu_full"]}), flush=True)
    cached = engine(True)
    rows["gpu_pool_hit"] = _row(cached.generate, prompts)
    print(json.dumps({"gpu_pool_hit": rows["gpu_pool_hit"]}), flush=True)

    def evict():  # an unrelated prompt as long: the pool's least recently used blocks (the prefix's) go to the host
        cached.generate([rng.integers(0, cfg.vocab_size, length).tolist()],
                        SamplingParams(max_tokens=1, ignore_eos=True))

    rows["gpu_host_tier_hit"] = _row(cached.generate, prompts, before=evict)
    rows["gpu_host_tier_hit"]["host_tier_blocks"] = cached.blocks.num_host_blocks
    print(json.dumps({"gpu_host_tier_hit": rows["gpu_host_tier_hit"]}), flush=True)
    del cached, llm
    for caching in (False, True):
        off = LLM.from_params(cfg, params, dtype="bfloat16", max_model_len=2 * length + a.offload_block, offload=True,
                              prefill="chunked", block_size=a.offload_block, enable_prefix_caching=caching)
        name = "offload_store_hit" if caching else "offload_full"
        rows[name] = _row(off.generate, prompts)
        print(json.dumps({name: rows[name]}), flush=True)
        del off
    return rows


def main() -> None:
    import jax.numpy as jnp
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--num-layers", type=int, help="fewer layers, for a smoke run")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--ratios", default="0.15,0")
    p.add_argument("--prefix-tokens", type=int, default=32768)
    p.add_argument("--pool-prompts", type=float, default=1.5)
    p.add_argument("--offload-block", type=int, default=OFFLOAD_DEFAULTS["block_size"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    phases = [x for x in a.phases.split(",") if x]
    if any(x not in PHASES for x in phases):
        p.error(f"phases must be among {', '.join(PHASES)}, got {a.phases!r}")
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(a.shape, a.num_layers)
    params = random_params(cfg, jnp.bfloat16)
    for phase in phases:
        rows = {"blend": phase_blend, "prefix": phase_prefix}[phase](a, cfg, params, np.random.default_rng(0))
        full = rows["full" if phase == "blend" else "gpu_full"]["ttft_s"]["median"]
        over = {k: v["ttft_s"]["median"] / full for k, v in rows.items()}
        if phase == "prefix":
            over["offload_store_hit"] = rows["offload_store_hit"]["ttft_s"]["median"] / \
                rows["offload_full"]["ttft_s"]["median"]
        (a.out / f"{phase}_ttft.json").write_text(json.dumps(
            {**run_metadata(), "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
             "over_full": over}, indent=1))
        print(json.dumps({phase: over}), flush=True)


if __name__ == "__main__":
    main()
