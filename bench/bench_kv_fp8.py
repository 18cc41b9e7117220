"""8-bit KV caches (fp8, int8) against the model-dtype cache on one GPU: Llama-3.1-8B shape, random bf16 weights.

  decode   offloaded decode at --ctx for each of --policies (full, quest, sketch), each of --kv-dtypes (auto first)
           in the same process: prefill seconds, ms/token (median, min, max of every step after a warm-up), the
           bytes a step moves over PCIe, and the PCIe floor of full decode (the host blocks' bytes / the measured
           host->GPU bandwidth)
  batch    continuous batching with the KV in GPU memory, the pool sized by --gpu-memory-utilization: the pool's
           blocks (tokens, and sequences of --batch-prompt + --batch-tokens) for each of --kv-dtypes, and output
           tokens/s of --batch-seqs such requests (one warm-up run, then --repeats timed)
  long     one --long-ctx prompt, fp8 KV offloaded, for each of --long-policies (full, sketch): chunked prefill
           in --long-block-size chunks (XAttention at a fixed --long-density of each query block's key blocks, or
           full attention with --long-density 0), then --long-tokens decoded: seconds, ms/token, peak GPU memory
           and pinned host bytes. Chunked, because layerwise prefill holds one layer's activations for the whole
           prompt (at 1M tokens of the 8B shape, past an H200's memory) and its XAttention estimate would be
           traced in thousands of query chunks

    python bench/bench_kv_fp8.py --phases decode --out $OUT/kv_fp8
    python bench/bench_kv_fp8.py --phases batch --gpu-memory-utilization 0.2 --batch-seqs 96 --batch-prompt 1024 \
        --batch-tokens 128 --out $OUT/kv_fp8   # a pool that holds about half the requests in bf16
    python bench/bench_kv_fp8.py --phases long --long-policies full --out $OUT/kv_fp8

Every phase writes <out>/kv_fp8_<phase>.json with the run's device, versions and date, and each row as it finishes
(<out>/kv_fp8_<phase>_<...>.json: a run stopped by a time limit keeps them).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB, RandomModel, gpu_memory, h2d_bandwidth, model_config, random_params, run_metadata, stats,
)

from jax_offload.config import OFFLOAD_DEFAULTS, PAGE_POLICY_DEFAULTS, EngineConfig  # noqa: E402


def _policy_options(policy: str, a) -> dict:
    """A decode policy's options; the rest (pages, dense layers, the sketch's dtype) are the engine's defaults."""
    return {} if policy == "full" else dict(decode_policy=policy, decode_budget=a.budget)


def phase_decode(a) -> dict:
    from jax_offload.kv.ring import group_size

    m = RandomModel(a.shape, a.num_layers, tokens=a.decode_tokens)
    cfg = m.cfg
    bs, n = a.block_size, m.prompt_len(a.ctx)
    bandwidth = h2d_bandwidth()
    rows = []
    for policy in a.policies:
        for kv in a.kv_dtypes:
            llm = m.llm(offload=True, block_size=bs, num_ring_slots=a.ring_slots,
                        max_model_len=min(max(n, 2 * group_size(a.ring_slots) * bs) + a.decode_tokens + bs,
                                          cfg.max_position_embeddings),
                        kv_cache_dtype=kv, **_policy_options(policy, a))
            # The timed prompt's decode shapes first: one full group of blocks, its last group, its tail.
            group = group_size(a.ring_slots)
            m.generate(llm, (group + (n // bs) % group) * bs + n % bs, 2)
            out = m.generate(llm, n)
            runner = llm._runner
            row = {"policy": policy, "kv_cache_dtype": kv, "ctx": n, "prefill_s": out.prefill_seconds,
                   "decode_ms": stats([s * 1e3 for s in out.decode_token_seconds[1:]]),
                   "pcie_bytes_per_token": runner.last_decode_pcie_bytes,
                   "host_store_GiB": runner.store.host_bytes / GiB, "gpu_memory": gpu_memory()}
            if policy == "full":
                row["pcie_floor_ms"] = runner.last_decode_pcie_bytes / bandwidth["median"] * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
            (a.out / f"kv_fp8_decode_{policy}_{kv}.json").write_text(json.dumps({**run_metadata(), **row}, indent=1))
            del llm, runner, out
            gc.collect()
    ratios = {}
    for policy in a.policies:
        by = {r["kv_cache_dtype"]: r for r in rows if r["policy"] == policy}
        ratios[policy] = {kv: by[kv]["decode_ms"]["median"] / by["auto"]["decode_ms"]["median"]
                          for kv in a.kv_dtypes if kv != "auto"}
    return {"rows": rows, "over_auto": ratios, "h2d_bandwidth": bandwidth, "block_size": bs,
            "ring_slots": a.ring_slots, "budget": a.budget}


def phase_batch(a) -> dict:
    import jax

    from jax_offload import SamplingParams

    m = RandomModel(a.shape, a.num_layers)
    prompts = [m.prompt(a.batch_prompt) for _ in range(a.batch_seqs)]
    sampling = SamplingParams(temperature=0.0, max_tokens=a.batch_tokens, ignore_eos=True)
    seq_len = a.batch_prompt + a.batch_tokens
    rows = []
    for kv in a.kv_dtypes:
        llm = m.llm(max_model_len=seq_len + 1, kv_cache_dtype=kv, max_num_seqs=a.batch_seqs,
                    max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=a.gpu_memory_utilization)
        engine = llm._batch()
        blocks, block_size = engine.runner.num_blocks, engine.runner.block_size
        llm.generate(prompts[: max(1, a.batch_seqs // 8)], sampling)  # warm-up: compiles the steps
        seconds = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            outs = llm.generate(prompts, sampling)
            seconds.append(time.perf_counter() - start)
        tokens = sum(len(o.token_ids) for o in outs)
        row = {"kv_cache_dtype": kv, "pool_blocks": blocks, "block_size": block_size,
               "pool_tokens": blocks * block_size, "sequences_that_fit": blocks * block_size // seq_len,
               "output_tokens": tokens, "seconds": stats(seconds),
               "output_tok_per_s": stats([tokens / s for s in seconds]), "gpu_memory": gpu_memory()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / f"kv_fp8_batch_{kv}.json").write_text(json.dumps({**run_metadata(), **row}, indent=1))
        del llm, engine
        gc.collect()
        jax.clear_caches()
    by = {r["kv_cache_dtype"]: r["output_tok_per_s"]["median"] for r in rows}
    return {"rows": rows, "batch_seqs": a.batch_seqs, "prompt_tokens": a.batch_prompt,
            "output_tokens_each": a.batch_tokens, "gpu_memory_utilization": a.gpu_memory_utilization,
            "tok_per_s_over_auto": {kv: by[kv] / by["auto"] for kv in by if kv != "auto"}}


def phase_long(a) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jax_offload import LLM, SamplingParams

    cfg = model_config(a.shape, a.num_layers)
    n = a.long_ctx
    # Llama-3.1's RoPE (factor 8 over an 8K original window: 128K positions), its factor scaled to cover the prompt.
    window = n + a.long_tokens + a.long_block_size
    factor = max(cfg.rope.factor, cfg.rope.factor * window / cfg.max_position_embeddings)
    rope = dataclasses.replace(cfg.rope, factor=factor)
    cfg = dataclasses.replace(cfg, max_position_embeddings=window, rope=rope)
    params = random_params(cfg, jnp.bfloat16)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=n).tolist()
    xattn = dict(prefill_policy="xattention", xattn_density=a.long_density) if a.long_density > 0 else {}
    rows = []
    for policy in a.long_policies:
        llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=a.long_block_size,
                              num_ring_slots=a.ring_slots, prefill="chunked", max_model_len=n + a.long_tokens + 1,
                              max_num_seqs=1,  # one request: GPU memory for a prefill mirror, not for 255 more tails
                              kv_cache_dtype="fp8", **xattn, **_policy_options(policy, a))
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=a.long_tokens, ignore_eos=True),
                           progress=True)[0]  # the prefill bar on stderr: a run stopped by a time limit shows its rate
        row = {"policy": policy, "ctx": n, "prefill_s": out.prefill_seconds,
               "decode_ms": stats([s * 1e3 for s in out.decode_token_seconds[1:]]),
               "first_step_ms": out.decode_token_seconds[0] * 1e3 if out.decode_token_seconds else None,
               "prefill_density_mean": (float(np.mean(out.prefill_density)) if out.prefill_density else None),
               "prefill_pcie_GB": llm._runner.last_prefill_pcie_bytes / 1e9,
               "prefill_mirror": llm._runner.last_prefill_mirror,
               "pinned_host_GiB": llm._runner.store.host_bytes_held() / GiB, "gpu_memory": gpu_memory()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / f"kv_fp8_long_{policy}.json").write_text(json.dumps({**run_metadata(), **row}, indent=1))
        del llm, out
        gc.collect()
    return {"rows": rows, "rope": dataclasses.asdict(rope), "xattn_density": a.long_density,
            "block_size": a.long_block_size}


PHASES = {"decode": phase_decode, "batch": phase_batch, "long": phase_long}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")) / "kv_fp8")
    p.add_argument("--phases", default="decode")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--num-layers", type=int, help="fewer layers, for a smoke run")
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--policies", type=lambda s: s.split(","), default=["full", "quest", "sketch"])
    p.add_argument("--block-size", type=int, default=OFFLOAD_DEFAULTS["block_size"])
    p.add_argument("--ring-slots", type=int, default=OFFLOAD_DEFAULTS["num_ring_slots"])
    p.add_argument("--budget", type=int, default=PAGE_POLICY_DEFAULTS["decode_budget"])
    p.add_argument("--decode-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=["auto", "fp8", "int8"])
    p.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization)
    p.add_argument("--batch-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--batch-prompt", type=int, default=4096)
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--long-ctx", type=int, default=1 << 20)
    p.add_argument("--long-tokens", type=int, default=32)
    p.add_argument("--long-density", type=float, default=0.05)
    p.add_argument("--long-block-size", type=int, default=16384)
    p.add_argument("--long-policies", type=lambda s: s.split(","), default=["full", "sketch"])
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if "long" in a.phases.split(","):
        # XLA reads its pinned-pool limit when the GPU backend starts: size it for the long prompt's fp8 store and,
        # for the page policies, the chunked prefill's mirror of their page layers (as the CLI does).
        from jax_offload.kv.host_store import pinned_bytes, pinned_limit_gb

        cfg = model_config(a.shape, a.num_layers)
        shape = (cfg.num_layers, a.long_ctx + a.long_tokens + a.long_block_size, cfg.num_kv_heads, cfg.head_dim,
                 "fp8", "bfloat16")
        sparse_layers = cfg.num_layers - PAGE_POLICY_DEFAULTS["dense_layers"]
        mirror = pinned_bytes(*shape, mirror_layers=sparse_layers) if set(a.long_policies) - {"full"} else None
        os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(pinned_limit_gb(pinned_bytes(*shape), mirror)))
    for name in a.phases.split(","):
        start = time.perf_counter()
        result = {**run_metadata(), "phase": name, "args": {k: str(v) for k, v in vars(a).items()},
                  **PHASES[name](a), "wall_s": None}
        result["wall_s"] = time.perf_counter() - start
        (a.out / f"kv_fp8_{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
