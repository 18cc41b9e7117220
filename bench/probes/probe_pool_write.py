"""Probe: the time CacheBlend's `generate` spends writing the prompt's K and V into the pool (20 ms of a 316 ms TTFT on
an H200, `runs/h200_kv_reuse/blend_parts/`, for 4.3 GB that HBM moves in ~2 ms). 32 layers, K and V
[1, 36864, 8, 128] bf16 into pools of 256-token blocks, the sequence's 129 blocks scattered over the pool; each
figure the median (min-max) of 5 runs after two untimed ones:
- `row_scatter_big_pool` / `row_scatter_small_pool`: `model_runner._write_prompt_kv` (a scatter of token rows) into
  a pool of ~40 GB and of ~4.5 GB (if the time follows the pool's size, the pool is copied, not written in place);
- `block_scatter_big_pool`: the same bytes written a block at a time (`unique_indices`);
writes probe_pool_write.json under $OUT, with the rows where the two variants' pools differ (those past the prompt in
its last block, which only the block scatter writes).

    python bench/probes/probe_pool_write.py
"""
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

from common import probe_output, run_metadata, stats  # noqa: E402
from jax_offload.serving.model_runner import _write_prompt_kv  # noqa: E402

LAYERS, TOKENS, HKV, D, BS = (int(os.environ.get(k, v)) for k, v in
                               (("LAYERS", 32), ("TOKENS", 36864), ("HKV", 8), ("D", 128), ("BS", 256)))
PROMPT = TOKENS - 4016  # rows past the prompt write nothing
BIG, SMALL = int(os.environ.get("BIG_BLOCKS", 1200)), int(os.environ.get("SMALL_BLOCKS", 160))


def timed(fn) -> dict:
    seconds = []
    for i in range(7):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= 2:
            seconds.append(time.perf_counter() - start)
    return stats(seconds)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def block_write(k_pool, v_pool, blocks, ks, vs):
    def write(pool, x):
        return pool.at[blocks].set(x[0].reshape(-1, *pool.shape[1:]), mode="drop", unique_indices=True)
    return tuple(map(write, k_pool, ks)), tuple(map(write, v_pool, vs))


def main() -> None:
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    ks = tuple(jax.random.normal(jax.random.fold_in(key, i), (1, TOKENS, HKV, D), jnp.bfloat16) for i in range(LAYERS))
    vs = tuple(jax.random.normal(jax.random.fold_in(key, 100 + i), (1, TOKENS, HKV, D), jnp.bfloat16)
               for i in range(LAYERS))
    result = {**run_metadata(), "layers": LAYERS, "tokens": TOKENS, "prompt": PROMPT, "block_size": BS}
    pools = {}
    for name, num_blocks in (("small", SMALL), ("big", BIG)):
        seq_blocks = rng.permutation(num_blocks)[: -(-PROMPT // BS)].astype(np.int32)
        slots = np.full(TOKENS, -1, np.int32)
        slots[:PROMPT] = seq_blocks[np.arange(PROMPT) // BS] * BS + np.arange(PROMPT) % BS
        blocks = num_blocks + np.arange(TOKENS // BS, dtype=np.int32)  # past the prompt's blocks: dropped, unique
        blocks[: len(seq_blocks)] = seq_blocks
        slots, blocks = jnp.asarray(slots), jnp.asarray(blocks)
        for variant in ("row_scatter", "block_scatter") if name == "big" else ("row_scatter",):
            state = [tuple(jnp.zeros((num_blocks, BS, HKV, D), jnp.bfloat16) for _ in range(LAYERS)) for _ in "kv"]

            def write():
                if variant == "row_scatter":
                    state[:] = _write_prompt_kv(("auto",) * LAYERS, *state, slots, ks, vs)
                else:
                    state[:] = block_write(*state, blocks, ks, vs)
                return state
            result[f"{variant}_{name}_pool"] = timed(write)
            result[f"{variant}_{name}_pool_gb"] = 2 * LAYERS * num_blocks * BS * HKV * D * 2 / 1e9
            print(variant, name, result[f"{variant}_{name}_pool"], flush=True)
            if name == "big":
                pools[variant] = state[0][LAYERS - 1]
            del state
    # The prompt's last block: the block scatter writes its rows past the prompt too, the row scatter leaves them 0.
    result["differing_rows"] = int((pools["row_scatter"] != pools["block_scatter"]).any(axis=(2, 3)).sum())
    result["rows_past_prompt_in_last_block"] = -(-PROMPT // BS) * BS - PROMPT
    print({k: v for k, v in result.items() if "rows" in k}, flush=True)
    probe_output("probe_pool_write.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
