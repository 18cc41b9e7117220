"""Probe: where CacheBlend's time to first token goes (issue 63 asks <= 0.25x full prefill; 0.359x on 2026-11-29,
`runs/h200_kv_reuse/`). The README's workload (DOCS documents of DOC_TOKENS tokens, all kept, a new 64-token
question, Llama-3.1-8B shape, random bf16), each figure the median (min-max) of REPEATS runs after two untimed ones:
- `generate_ttft`: `LLM.generate` of a `Segments` prompt, one token (what bench_kv_reuse.py times);
- `prefill`: `BlendRunner.prefill` alone, at ratio 0.15 and 0 (the engine's scheduling and first draw left out);
- `move_grouped`: the kept segments' KV to the GPU as `prefill` moves it (an array per segment, group of
  KEPT_GROUP layers and K or V);
- `move_one`: the same bytes as one pinned array (the link's rate for one copy);
- `attention_by_position`, `attention_reversed_keys`: the recompute's attention at one layer, as the blend runs it
  (the Triton kernel: queries picked by position) and with the keys reversed (the Hopper kernel: each row's first
  key instead of its last);
- `compute`, `compute_then_move`, `move_then_compute`: a chain of bf16 matmuls alone, and with the move queued
  after it or before it (whether the move runs under compute).
So: the blend's time beyond the move, whether the move is hidden, and what is left for the engine around the
prefill. Writes probe_blend_parts.json under $OUT (SHAPE=qwen3-0.6b LAYERS=2 DOCS=2
DOC_TOKENS=256 MATMUL=256 for a CPU smoke test).

    python bench/probes/probe_blend_parts.py
"""
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

from common import host_profile, model_config, probe_output, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM, SamplingParams, Segments  # noqa: E402
from jax_offload.blend import _to_device, _to_host, chained_key  # noqa: E402
from jax_offload.buckets import cache_bucket, prompt_bucket  # noqa: E402
from jax_offload.serving.model_runner import _write_prompt_kv  # noqa: E402
from pallas_kernels.attention import attention_with_lse  # noqa: E402

SHAPE, LAYERS = os.environ.get("SHAPE", "llama-3.1-8b"), os.environ.get("LAYERS")
DOCS, DOC_TOKENS = int(os.environ.get("DOCS", 16)), int(os.environ.get("DOC_TOKENS", 2048))
QUESTION, REPEATS = 64, int(os.environ.get("REPEATS", 5))
MATMUL = int(os.environ.get("MATMUL", 8192))


def timed(fn) -> dict:
    """Median (min-max) seconds of `fn()` (its outputs waited for) over REPEATS runs after two untimed ones."""
    seconds = []
    for i in range(REPEATS + 2):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= 2:
            seconds.append(time.perf_counter() - start)
    return stats(seconds)


def pinned_stack(arrays: list[jax.Array]) -> jax.Array:
    """One pinned host array of `arrays` joined on their first axis (built in GPU memory, then moved)."""
    return _to_host(jnp.concatenate(_to_device(arrays)))


def engine_parts(llm, runner, generate, prompt, total: int, result: dict) -> None:
    """What `generate` adds to the blend prefill: the prompt's K and V written into the pool, and the host's time by
    function (cProfile of one `generate`, the 25 largest cumulative times)."""
    mr = llm._batch().runner
    kv = runner.prefill(prompt(), total)
    blocks = np.arange(-(-kv.k[0].shape[1] // mr.block_size), dtype=np.int32)  # the pool's first blocks
    blocks, length = mr.tp.replicate((blocks, np.int32(total)))
    dtypes = tuple(layer.kv_cache_dtype for layer in mr.params.layers)

    def write():
        mr.k_pool, mr.v_pool = _write_prompt_kv(dtypes, mr.k_pool, mr.v_pool, blocks, length, tuple(kv.k),
                                                tuple(kv.v))
        return mr.k_pool

    result["pool_write"] = timed(write)
    result["generate_profile"] = host_profile(generate, (("cumulative", 25),))
    print(result["generate_profile"], flush=True)


def attention_parts(cfg, total: int, rng: np.random.Generator, result: dict) -> None:
    """The recompute's attention at one layer: the chosen rows (15% of the prompt, and the question) over the whole
    cache, as the blend runs it (`q_positions`: the Triton kernel) and as the Hopper kernel can (keys reversed,
    each row seeing keys from Tk-1-position on); the two outputs' largest difference."""
    n_picked = int(0.15 * (total - QUESTION)) + QUESTION
    size, tk = prompt_bucket(n_picked), cache_bucket(total + 16)
    pos = np.sort(np.concatenate([rng.choice(total - QUESTION, n_picked - QUESTION, replace=False),
                                  np.arange(total - QUESTION, total)]))
    pos = jnp.asarray(np.concatenate([pos, np.full(size - n_picked, pos[-1])]).astype(np.int32))[None]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, size, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, tk, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16) for key in keys[1:])
    by_position = jax.jit(lambda q, k, v, pos: attention_with_lse(q, k, v, causal=True, kv_len=total,
                                                                  q_positions=pos, out_dtype=jnp.float32)[0])
    reversed_keys = jax.jit(lambda q, k, v, pos: attention_with_lse(
        q, jnp.flip(k, 1), jnp.flip(v, 1), kv_start=k.shape[1] - 1 - pos, out_dtype=jnp.float32)[0])
    result["attention_rows"], result["attention_keys"] = size, tk
    result["attention_by_position"] = timed(lambda: by_position(q, k, v, pos))
    result["attention_reversed_keys"] = timed(lambda: reversed_keys(q, k, v, pos))
    result["attention_max_abs_diff"] = float(jnp.abs(by_position(q, k, v, pos) - reversed_keys(q, k, v, pos)).max())


def main() -> None:
    cfg = model_config(SHAPE, int(LAYERS) if LAYERS else None)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.vocab_size, DOC_TOKENS).tolist() for _ in range(DOCS)]
    total = DOCS * DOC_TOKENS + QUESTION
    llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", max_model_len=total + 16,
                          enable_prefix_caching=True, prefix_cache_host_gb=DOCS * DOC_TOKENS * cfg.kv_bytes_per_token
                          / 2**30 + 1, blend_recompute_ratio=0.15, gpu_memory_utilization=0.5)
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt() -> list[list[int]]:
        return [docs[i] for i in rng.permutation(DOCS)] + [rng.integers(0, cfg.vocab_size, QUESTION).tolist()]

    result = {**run_metadata(), "shape": SHAPE, "layers": cfg.num_layers, "docs": DOCS, "doc_tokens": DOC_TOKENS,
              "repeats": REPEATS}
    result["generate_ttft"] = timed(lambda: llm.generate([Segments(prompt())], one_token)[0].token_ids)
    runner = llm._blend_runner()
    engine_parts(llm, runner, lambda: llm.generate([Segments(prompt())], one_token), prompt, total, result)
    if os.environ.get("PARTS") == "engine":
        probe_output("probe_blend_parts.json").write_text(json.dumps(result, indent=1))
        return
    for ratio in (0.15, 0.0):
        runner.ratio = ratio
        result[f"prefill_ratio_{ratio}"] = timed(lambda: runner.prefill(prompt(), total))
    kept = [runner.store.get(chained_key(runner.tag, doc)) for doc in docs]
    grouped = [(kv.keys, kv.values) for kv in kept]
    result["move_bytes"] = sum(kv.nbytes for kv in kept)
    result["move_grouped"] = timed(lambda: _to_device(grouped))
    one = pinned_stack([x for kv in kept for x in (*kv.keys, *kv.values)])
    result["move_one"] = timed(lambda: _to_device(one))
    del one
    a = jnp.ones((MATMUL, MATMUL), jnp.bfloat16)
    chain = jax.jit(lambda a: jax.lax.fori_loop(0, 60, lambda i, x: (x @ a) * 1e-4, a))
    result["compute"] = timed(lambda: chain(a))
    result["compute_then_move"] = timed(lambda: (chain(a), _to_device(grouped)))
    result["move_then_compute"] = timed(lambda: (_to_device(grouped), chain(a)))
    attention_parts(cfg, total, rng, result)
    for name, row in result.items():
        if isinstance(row, dict):
            print(f"{name}: {row['median'] * 1e3:.1f} ms ({row['min'] * 1e3:.1f}-{row['max'] * 1e3:.1f})", flush=True)
    probe_output("probe_blend_parts.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
