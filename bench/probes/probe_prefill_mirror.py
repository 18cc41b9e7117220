"""Where a chunked sketch prefill should read its page layers' earlier blocks (issue 63's 1M prompt, whose mirror does
not fit a 125 GiB host beside its store): from the prefill mirror in GPU memory, from the mirror in pinned memory,
or from the layers' one pinned buffer (no mirror). Llama-3.1-8B shape cut to LAYERS (8) layers, random bf16, CTX
(524288) tokens, fp8 KV offloaded, BLOCK-token chunks (16384), XAttention at 5%, sketch decode (2 dense layers);
the same prompt prefilled with each mirror in one process (one request: `max_num_seqs=1`, so the batch engine
keeps one tail slot and the GPU has room for a mirror), the first run repeated last (it compiled). Writes
probe_prefill_mirror.json under $OUT after every run.

    python bench/probes/probe_prefill_mirror.py
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

from common import model_config, probe_output, random_params, run_metadata  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload.kv import host_store  # noqa: E402

CTX, LAYERS = int(os.environ.get("CTX", 1 << 19)), int(os.environ.get("LAYERS", 8))
BLOCK = int(os.environ.get("BLOCK", 16384))


def main():
    cfg = model_config(os.environ.get("SHAPE", "llama-3.1-8b"), LAYERS)
    window = CTX + 2 * BLOCK
    rope = dataclasses.replace(cfg.rope, factor=max(cfg.rope.factor,
                                                    cfg.rope.factor * window / cfg.max_position_embeddings))
    cfg = dataclasses.replace(cfg, max_position_embeddings=window, rope=rope)
    llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", offload=True, block_size=BLOCK,
                          prefill="chunked", max_model_len=CTX + BLOCK, max_num_seqs=1, kv_cache_dtype="fp8",
                          prefill_policy="xattention", xattn_density=0.05, decode_policy="sketch")
    store = llm._runner.store
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=CTX).tolist()
    free, limit = host_store.device_free_bytes, host_store.pinned_limit_bytes
    result = {**run_metadata(), "ctx": CTX, "layers": LAYERS, "block": BLOCK, "runs": []}
    tokens = []
    for mirror in ("device", None, "pinned_host", "device"):
        host_store.device_free_bytes = free if mirror == "device" else (lambda tp: 0)
        host_store.pinned_limit_bytes = limit if mirror else (lambda: store.host_bytes)
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
        tokens.append(out.token_ids)
        run = {"mirror": mirror, "prefill_s": out.prefill_seconds, "read_from": llm._runner.last_prefill_mirror,
               "prefill_pcie_GB": llm._runner.last_prefill_pcie_bytes / 1e9}
        result["runs"].append(run)
        result["same_tokens"] = all(t == tokens[0] for t in tokens)
        print(json.dumps(run), flush=True)
        probe_output("probe_prefill_mirror.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
