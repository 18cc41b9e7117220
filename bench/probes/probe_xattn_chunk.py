"""Where a 1M-token prompt's chunked XAttention prefill spends a chunk's layer (issue 63: 409 s for 1,048,576 tokens on
an H200, ~4.9 ms per layer and earlier 16K block, the target 5 minutes): one layer of the Llama-3.1-8B shape, random
bf16, a 16K-token chunk after SPANS' earlier keys, XAttention at 5%; times the whole `xattn_chunk_layer`, and apart its
estimate and choice (`xattn_select`), its block-sparse attention, and the chunk's q/k/v (`chunk_begin`), each the
median of REPEATS runs after a warm-up (min and max beside it). Also the compile time of each span's program.
KEY_SPLIT sets the score kernel's key tiles per program (`pallas_kernels.xattn.KEY_SPLIT_TILES`; 1048576: one
program per query block and head, as before). Writes probe_xattn_chunk[_KEY_SPLIT].json under $OUT.

    python bench/probes/probe_xattn_chunk.py
    KEY_SPLIT=1048576 SPANS=1048576 python bench/probes/probe_xattn_chunk.py
"""
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.xattn  # noqa: E402
from common import model_config, probe_output, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM  # noqa: E402
from jax_offload.attention import chunk_begin, xattn_attention, xattn_chunk_layer, xattn_select  # noqa: E402

BLOCK = int(os.environ.get("BLOCK", 16384))
SPANS = [int(s) for s in os.environ.get("SPANS", "262144,524288,1048576").split(",")]
REPEATS = int(os.environ.get("REPEATS", 5))
KEY_SPLIT = int(os.environ.get("KEY_SPLIT", pallas_kernels.xattn.KEY_SPLIT_TILES))
pallas_kernels.xattn.antidiagonal_scores.__kwdefaults__["key_split"] = KEY_SPLIT


def timed(fn, repeats=REPEATS):
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return stats(times)


def main():
    cfg = model_config(os.environ.get("SHAPE", "llama-3.1-8b"), 1)
    window = max(SPANS) + 2 * BLOCK
    rope = dataclasses.replace(cfg.rope, factor=cfg.rope.factor * window / cfg.max_position_embeddings)
    cfg = dataclasses.replace(cfg, max_position_embeddings=window, rope=rope)
    llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", offload=True, block_size=BLOCK,
                          prefill="chunked", max_model_len=window, max_num_seqs=1, kv_cache_dtype="fp8",
                          prefill_policy="xattention", xattn_density=0.05, decode_policy="sketch", dense_layers=0)
    r = llm._runner
    layer, xattn, impl, tp = r.params.layers[0], r.xattn, r.impl, r.tp
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((1, BLOCK, cfg.hidden_size)), jnp.bfloat16)
    shape = (1, window, cfg.num_kv_heads, cfg.head_dim)
    keys = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    result = {**run_metadata(), "key_split_tiles": KEY_SPLIT, "block": BLOCK, "xattn": str(xattn), "impl": impl, "spans": []}
    for span in SPANS:
        start = span - BLOCK
        row = {"span": span, "earlier_blocks": start // BLOCK}
        s, n = np.int32(start), np.int32(BLOCK)
        row["chunk_begin_ms"] = timed(lambda: chunk_begin(cfg, layer, h, r.inv_freq, s, tp=tp))
        q, kv, _ = chunk_begin(cfg, layer, h, r.inv_freq, s, tp=tp)
        k, v = keys[:, :span], values[:, :span]
        select = jax.jit(functools.partial(xattn_select, impl, xattn, tp=tp))
        t0 = time.perf_counter()
        mask = jax.block_until_ready(select(q, k, q_offset=s, kv_len=np.int32(span)))
        row["select_compile_s"] = time.perf_counter() - t0
        row["select_ms"] = timed(lambda: select(q, k, q_offset=s, kv_len=np.int32(span)))
        attend = jax.jit(functools.partial(xattn_attention, impl, xattn, causal=True, out_dtype=jnp.bfloat16, tp=tp))
        row["attention_ms"] = timed(lambda: attend(q, k, v, mask, q_offset=s, kv_len=np.int32(span)))
        row["density"] = float(jnp.mean(mask.astype(jnp.float32)))
        state = {"keys": keys, "values": values}

        def layer_call():
            out, state["keys"], state["values"], counts = xattn_chunk_layer(
                cfg, impl, xattn, layer, h, q, kv, state["keys"], state["values"], s, n, span=span, tp=tp)
            return out

        t0 = time.perf_counter()
        jax.block_until_ready(layer_call())
        row["layer_first_call_s"] = time.perf_counter() - t0
        row["layer_ms"] = timed(layer_call)
        keys, values = state["keys"], state["values"]
        row["layer_ms_per_earlier_block"] = row["layer_ms"]["median"] / max(1, row["earlier_blocks"])
        result["spans"].append(row)
        print(json.dumps(row), flush=True)
        probe_output(f"probe_xattn_chunk{'' if 'KEY_SPLIT' not in os.environ else '_' + str(KEY_SPLIT)}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
