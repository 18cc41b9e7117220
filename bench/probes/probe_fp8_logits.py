"""How far an 8-bit KV cache (--kv-dtype fp8 or int8) moves the real model's logits: SmolLM2-135M (bf16 weights),
the eight NIAH tasks' first --samples prompts at each length, the last --last positions' logits with
kv_cache_dtype auto and the 8-bit one (both in GPU memory: offloaded gives the same logits, `tests/test_kv_fp8.py`). Writes max and mean |d|, the logit
scale, and top-1 agreement.

    python bench/probes/probe_fp8_logits.py --model DIR --lengths 4096,8192 --out $OUT/probe_fp8_logits.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import run_metadata  # noqa: E402
from eval_sparse import build_prompts  # noqa: E402


def main() -> None:
    import numpy as np

    from jax_offload import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--last", type=int, default=64)
    p.add_argument("--kv-dtype", default="fp8")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = build_prompts(a.model, {n: n - 32 for n in lengths}, a.samples, 42)
    base = dict(dtype="bfloat16", max_model_len=max(lengths))
    llms = {kv: LLM(a.model, kv_cache_dtype=kv, **base) for kv in ("auto", a.kv_dtype)}
    rows = []
    for n, samples in prompts.items():
        d_max, d_mean, scale, top1 = [], [], [], []
        for s in samples:
            auto, quant = (llms[kv].logits(s.prompt_ids, last=a.last) for kv in ("auto", a.kv_dtype))
            d = np.abs(quant - auto)
            d_max.append(float(d.max()))
            d_mean.append(float(d.mean()))
            scale.append(float(np.abs(auto).max()))
            top1.append(float(np.mean(quant.argmax(-1) == auto.argmax(-1))))
        rows.append({"length": n, "prompts": len(samples), "max_abs_diff": max(d_max),
                     "mean_abs_diff": float(np.mean(d_mean)), "max_abs_logit": max(scale),
                     "top1_agreement": float(np.mean(top1))})
        print(json.dumps(rows[-1]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({**run_metadata(), "kv_cache_dtype": a.kv_dtype, "last_positions": a.last,
                                 "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
