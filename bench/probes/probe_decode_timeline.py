"""Where a sketch decode step's time goes at 128K (Llama-3.1-8B shape, random bf16, offloaded, budget 4096, page 16, 2
dense layers, block 4096, ring 4; env SPARSE_CACHE_GB for a GPU cache of chosen pages, RING for the ring's slots, KV
for the KV cache dtype, BATCH=N for N such requests decoding together on the batch engine, the store sized for all
of them; one request runs there too where `LLM.generate` takes it there): one generate of 12 tokens after a warm-up,
recorded with jax.profiler.trace. For the decode steps (the trace's last window as long as decode steps 2-12 took by
the engine's own clock) it writes the GPU time per step by kernel (names with their digits dropped), the union of
busy GPU time, and the step's wall time, with the page cache's hit rate and the bytes over PCIe of the last step.
Writes probe_decode_timeline.json under $OUT (an H100's: `bench/results/runs/h100_decode_timeline/`).

    python bench/probes/probe_decode_timeline.py
"""
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import (  # noqa: E402
    decode_steps_by_kernel, model_config, probe_output, profiled, random_params, run_metadata,
)
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload.kv.ring import group_size  # noqa: E402

CTX, BLOCK, TOKENS = int(os.environ.get("CTX", 131072)), int(os.environ.get("BLOCK", 4096)), 12
SHAPE, LAYERS = os.environ.get("SHAPE", "llama-3.1-8b"), os.environ.get("LAYERS")  # a smaller model: a CPU smoke test
CACHE_GB, RING = float(os.environ.get("SPARSE_CACHE_GB", 0)), int(os.environ.get("RING", 4))
KV, BATCH = os.environ.get("KV", "auto"), int(os.environ.get("BATCH", 1))


def main():
    cfg = model_config(SHAPE, int(LAYERS) if LAYERS else None)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, CTX + 2 * BLOCK))
    params = random_params(cfg, jnp.bfloat16)
    max_len = CTX + TOKENS + BLOCK
    llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=BLOCK, num_ring_slots=RING,
                          max_model_len=max_len, host_kv_tokens=BATCH * max_len, max_num_seqs=BATCH,
                          decode_policy="sketch", decode_budget=min(4096, CTX // 4), page_size=16, dense_layers=2,
                          sketch_dtype="int4", sparse_cache_gb=CACHE_GB, kv_cache_dtype=KV)
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)

    def run(n, batch=1):
        return llm.generate([rng.integers(0, cfg.vocab_size, size=n).tolist() for _ in range(batch)], sampling)[0]

    # One prompt takes the batch engine too where `LLM.generate` routes it there (sketch on the Pallas kernels).
    batched = BATCH > 1 or llm._single_prompt_batches()
    if batched:
        run(CTX, BATCH)  # the batch engine's steps for these lengths, compiled
    else:
        for k in range(1, 2 * group_size(RING) + 2):
            run(k * BLOCK)
        run(BLOCK + 7)
    # The host's time in the runner's decode (it dispatches the step's programs and returns before they finish):
    # the one-request runner's, or the batch engine's.
    runner, dispatch_ms = llm._runner, []
    decoder = llm._batch_engine.runner if batched else runner
    name = "decode_async" if batched else "decode"
    decode = getattr(decoder, name)

    def timed_decode(*args, **kwargs):
        start = time.perf_counter()
        out = decode(*args, **kwargs)
        dispatch_ms.append((time.perf_counter() - start) * 1e3)
        return out

    setattr(decoder, name, timed_decode)
    outs = []
    data = profiled(lambda: outs.append(run(CTX, BATCH)))
    out = outs[0]
    steps = [s * 1e3 for s in out.decode_token_seconds]
    lines = {line.name: len(list(line.events)) for plane in data.planes if plane.name.startswith("/device:GPU")
             for line in plane.lines}
    result = {**run_metadata(), "ctx": CTX, "batch": BATCH, "kv_cache_dtype": KV, "ring_slots": RING,
              "sparse_cache_gb": CACHE_GB, "decode_step_ms": steps,
              "runner_decode_host_ms": dispatch_ms, "prefill_s": out.prefill_seconds,
              "pcie_bytes_last_step": runner.page_cache.totals()[2] * runner.page_bytes // cfg.num_kv_heads
              if batched and runner.page_cache else runner.last_decode_pcie_bytes,  # the batch moves only misses
              "page_cache_hit_rate": runner.page_cache.hit_rate() if runner.page_cache else None, "gpu_lines": lines,
              **decode_steps_by_kernel(data, steps)}
    probe_output("probe_decode_timeline.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_kernel_ms_per_step", "host_events_in_window")}))
    for k, v in list(result["per_kernel_ms_per_step"].items())[:20]:
        print(f"{v['ms_per_step']:8.3f} ms {v['count_per_step']:7.1f}x  {k}")
    for k, v in list(result["host_events_in_window"].items())[:20]:
        print(f"host {v['total_ms']:9.3f} ms {v['count']:6d}x  {k}")


if __name__ == "__main__":
    main()
