"""One long sketch or Quest request through the batch engine (a batch of one) against the one-request path
(issue 63: `_run_request` goes, or becomes the batch of one).
Llama-3.1-8B shape, random bf16, CTX tokens (default 131072) offloaded, POLICY decode (sketch or quest; budget 4096,
page 16, 2 dense layers, int4 sketch), block 4096, RING ring slots (16), SPARSE_CACHE_GB of page cache (2). Each
path runs the prompt once to compile, then REPEATS (5) times in one process: each run's decode wall time per token
(tokens 2..TOKENS, default 32) as median (min-max) over the runs, the per-step times, the page cache's hit rate and
the bytes that crossed PCIe at the last step, and whether every run of both paths gave the same tokens. Both paths
are called directly (`LLM.generate` of one prompt now takes the batch engine). PATHS (default
one_request,batch_of_one) picks the paths; PROFILE=1 also runs each once more under cProfile and writes the host's
profile (by own time and by cumulative time) to probe_batch_of_one_profile_PATH.txt. The batch of one also reports
the host's time in each step's dispatch and in reading its tokens (`dispatch_ms`, `read_wait_ms`). Writes
probe_batch_of_one.json under $OUT (SHAPE=qwen3-0.6b LAYERS=3 CTX=8192 for a CPU smoke test).

    python bench/probes/probe_batch_of_one.py
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

from common import host_profile, model_config, probe_output, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload.serving import engine as batch_engine  # noqa: E402
from jax_offload.serving.engine import run_requests  # noqa: E402

CTX, BLOCK, TOKENS = int(os.environ.get("CTX", 131072)), 4096, int(os.environ.get("TOKENS", 32))
CACHE_GB, RING = float(os.environ.get("SPARSE_CACHE_GB", 2)), int(os.environ.get("RING", 16))
SHAPE, LAYERS = os.environ.get("SHAPE", "llama-3.1-8b"), os.environ.get("LAYERS")  # a smaller model: a CPU smoke test
POLICY = os.environ.get("POLICY", "sketch")
REPEATS = int(os.environ.get("REPEATS", 5))
PATHS, PROFILE = os.environ.get("PATHS", "one_request,batch_of_one").split(","), os.environ.get("PROFILE") == "1"


def main():
    cfg = model_config(SHAPE, int(LAYERS) if LAYERS else None)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, CTX + 2 * BLOCK))
    params = random_params(cfg, jnp.bfloat16)
    llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=BLOCK, num_ring_slots=RING,
                          max_model_len=CTX + TOKENS + BLOCK, max_num_seqs=1, decode_policy=POLICY,
                          decode_budget=min(4096, CTX // 4), page_size=16, dense_layers=2,
                          **(dict(sketch_dtype="int4") if POLICY == "sketch" else {}),
                          sparse_cache_gb=CACHE_GB)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=CTX).tolist()
    sampling = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    result = {**run_metadata(), "ctx": CTX, "policy": POLICY, "ring_slots": RING, "sparse_cache_gb": CACHE_GB,
              "tokens": TOKENS}
    tokens = {}
    runner = llm._runner

    def one_request():
        engine = llm._serial_engine()
        engine.add_request("alone", prompt, sampling)
        return run_requests(engine, ["alone"], None)[0]

    def pcie_bytes(path):  # the batch engine's step moves only the page cache's misses
        if path == "one_request" or runner.page_cache is None:
            return runner.last_decode_pcie_bytes
        return runner.page_cache.totals()[2] * runner.page_bytes // cfg.num_kv_heads

    # The host's time in each decode step's dispatch (`decode_async`, which returns before the device is done) and
    # in reading a step's tokens (waiting for the device): a host-bound step hardly waits.
    batch_runner, dispatch_seconds, read_seconds = llm._batch().runner, [], []

    def timed(fn, seconds):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds.append(time.perf_counter() - start)
            return out
        return run

    batch_runner.decode_async = timed(batch_runner.decode_async, dispatch_seconds)
    batch_engine.drawn_to_host = timed(batch_engine.drawn_to_host, read_seconds)
    paths = {"one_request": one_request, "batch_of_one": lambda: llm._batch().generate([prompt], sampling)[0]}
    for path, generate in ((p, paths[p]) for p in PATHS):
        generate()  # compiles
        dispatch_seconds.clear()
        read_seconds.clear()
        runs = [generate() for _ in range(REPEATS)]
        cache = runner.page_cache
        tokens[path] = [out.token_ids for out in runs]
        # A run's decode wall time per token (tokens 2..): run-ahead steps spread the per-step times (a step's time
        # runs from the later of its start and the last token's read), not their sum.
        per_run = [sum(out.decode_token_seconds[1:]) * 1e3 / (len(out.decode_token_seconds) - 1) for out in runs]
        result[path] = {"decode_ms_per_token": stats(per_run), "decode_ms_per_token_runs": per_run,
                        "step_ms": stats([s * 1e3 for out in runs for s in out.decode_token_seconds[1:]]),
                        "prefill_s": stats([out.prefill_seconds for out in runs]),
                        "page_cache_hit_rate": cache.hit_rate() if cache is not None else None,
                        "pcie_bytes_last_step": pcie_bytes(path)}
        if dispatch_seconds:
            result[path]["dispatch_ms"] = stats([s * 1e3 for s in dispatch_seconds])
            result[path]["read_wait_ms"] = stats([s * 1e3 for s in read_seconds])
        print(path, json.dumps(result[path]), flush=True)
        if PROFILE:
            probe_output(f"probe_batch_of_one_profile_{path}.txt").write_text(
                host_profile(generate, (("tottime", 40), ("cumtime", 60))))
    first = next(iter(tokens.values()))[0]
    result["same_tokens"] = all(t == first for runs in tokens.values() for t in runs)
    result["first_tokens"] = first  # to compare processes (an XLA flag, another tree)
    probe_output("probe_batch_of_one.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
