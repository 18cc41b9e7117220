"""One long sketch or Quest request through the batch engine (a batch of one) against the one-request path
(issue 63: `_run_request` goes, or becomes the batch of one).
Llama-3.1-8B shape, random bf16, CTX tokens (default 131072) offloaded, POLICY decode (sketch or quest; budget 4096,
page 16, 2 dense layers, int4 sketch), block 4096, RING ring slots (16), SPARSE_CACHE_GB of page cache (2). Each
path runs the prompt twice (the first compiles) in one process; the decode steps of the second are reported:
ms/token median (min-max) and mean of TOKENS tokens, the page cache's hit rate and the bytes that crossed PCIe at
the last step, and the tokens' equality. Both paths are called directly (`LLM.generate` of one prompt now takes the
batch engine). Writes probe_batch_of_one.json under $OUT (SHAPE=qwen3-0.6b LAYERS=3 CTX=8192 for a CPU smoke test).

    python bench/probes/probe_batch_of_one.py
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import model_config, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload.serving.engine import run_requests  # noqa: E402

CTX, BLOCK, TOKENS = int(os.environ.get("CTX", 131072)), 4096, int(os.environ.get("TOKENS", 16))
CACHE_GB, RING = float(os.environ.get("SPARSE_CACHE_GB", 2)), int(os.environ.get("RING", 16))
SHAPE, LAYERS = os.environ.get("SHAPE", "llama-3.1-8b"), os.environ.get("LAYERS")  # a smaller model: a CPU smoke test
POLICY = os.environ.get("POLICY", "sketch")


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

    for path, generate in (("one_request", one_request),
                           ("batch_of_one", lambda: llm._batch().generate([prompt], sampling)[0])):
        generate()  # compiles
        out = generate()
        cache = runner.page_cache
        tokens[path] = out.token_ids
        steps_ms = [s * 1e3 for s in out.decode_token_seconds[1:]]
        # The mean is the decode's wall time per token: run-ahead steps spread the median (a step's time runs from
        # the later of its start and the last token's read).
        result[path] = {"decode_ms": stats(steps_ms), "decode_ms_mean": sum(steps_ms) / len(steps_ms),
                        "prefill_s": out.prefill_seconds,
                        "page_cache_hit_rate": cache.hit_rate() if cache is not None else None,
                        "pcie_bytes_last_step": pcie_bytes(path)}
        print(path, json.dumps(result[path]), flush=True)
    result["same_tokens"] = tokens["one_request"] == tokens["batch_of_one"]
    Path(os.environ.get("OUT", "."), "probe_batch_of_one.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
