"""Where an in-GPU prefill's GPU time goes, by kernel (issue 28/30 follow-up: the RMSNorm tree was found this way).

Llama-3.1-8B shape, random bf16 weights, one --ctx prompt prefilled in GPU memory (max_tokens 1) with full attention
and with XAttention at 10% of the blocks, after a warm-up, under JAX's profiler. Per variant: the prefill's seconds
and, per compiled module, each kernel's total ms, calls and mean us on GPU 0. Writes probe_prefill_profile.json under
--out.

    python bench/probes/probe_prefill_profile.py --ctx 32768 --out $OUT/profile
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model_config, random_params, run_metadata  # noqa: E402
from probe_tp_decode import load_trace  # noqa: E402


def kernel_table(trace: Path, top: int = 25) -> dict:
    """Per compiled module, GPU 0's `top` kernels by total time: ms, calls, mean us."""
    events, names = load_trace(trace)
    by_module: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        if e.get("ph") == "X" and "GPU:0" in names.get((e["pid"], None), ""):
            by_module[e.get("args", {}).get("hlo_module", "?")][e["name"][:80]].append(e["dur"])
    out = {}
    for module, kernels in by_module.items():
        rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
        out[module] = {"total_ms": sum(sum(v) for v in kernels.values()) / 1e3,
                       "kernels": {n: {"ms": sum(v) / 1e3, "calls": len(v), "mean_us": sum(v) / len(v)}
                                   for n, v in rows}}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_offload import LLM, SamplingParams
    from jax_offload.sparse.xattention import XAttention

    a.out.mkdir(parents=True, exist_ok=True)
    cfg = model_config("llama-3.1-8b")
    llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", max_model_len=a.ctx + 16,
                          prefill_policy="xattention")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=a.ctx).tolist()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    result = {"meta": run_metadata() | {"ctx": a.ctx}, "variants": {}}
    for name, xattn in (("full", None), ("xattention_10pct", XAttention(stride=8, block=128, top_fraction=0.1))):
        llm._runner.xattn = xattn
        llm.generate([ids], one)
        seconds = llm.generate([ids], one)[0].prefill_seconds
        folder = a.out / f"trace_{name}"
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
            llm.generate([ids], one)
        trace = sorted(folder.rglob("perfetto_trace.json.gz"))[-1]
        result["variants"][name] = {"prefill_s": seconds, "by_module": kernel_table(trace)}
        shutil.rmtree(folder, ignore_errors=True)
        print(name, seconds, flush=True)
    (a.out / "probe_prefill_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
