"""Full offloaded decode and chunked prefill at ~127K: 1024-token blocks against 4096, beside the PCIe floor, one process.

`bench/bench_offload.py` times decode with 4096-token blocks and 4 ring slots (its defaults, 1.08-1.12x the floor);
the engine's default was 1024-token blocks and 16 slots (4096 since this ran). This times both, and 4096 x 4, on one
prompt (126,976 tokens in host blocks for every block size, 100 in the GPU tail), Llama-3.1-8B shape, random bf16
weights: per config one warm-up generation, then `--repeats` generations of `--tokens` steps (the first `--skip` of
each left out), their steps pooled, and each generation's prefill seconds. The floor is the host blocks' bytes over
the pinned-host -> GPU bandwidth measured first.

    python bench/probes/probe_decode_defaults.py --out $OUT
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--configs", type=lambda s: [tuple(int(x) for x in c.split(":")) for c in s.split(",")],
               default=[(1024, 16), (4096, 16), (4096, 4)], help="BLOCK_SIZE:RING_SLOTS,...")
p.add_argument("--host-tokens", type=int, default=31 * 4096)
p.add_argument("--tokens", type=int, default=12)
p.add_argument("--skip", type=int, default=2)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--shape", default="llama-3.1-8b")
p.add_argument("--out", type=Path, required=True)
a = p.parse_args()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import h2d_bandwidth, model_config, random_params, run_metadata, stats  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402


def main() -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    bandwidth = h2d_bandwidth()
    cfg = model_config(a.shape)
    params = random_params(cfg, jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, size=a.host_tokens + 100).tolist()
    sampling = SamplingParams(temperature=0.0, max_tokens=a.tokens + 1, ignore_eos=True)
    floor_ms = a.host_tokens * cfg.kv_bytes_per_token / bandwidth["median"] * 1e3
    rows = []
    for block_size, slots in a.configs:
        llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=block_size,
                              num_ring_slots=slots, max_model_len=cfg.max_position_embeddings)
        llm.generate([prompt], sampling)
        steps, prefill = [], []
        for _ in range(a.repeats):
            out = llm.generate([prompt], sampling)[0]
            prefill.append(out.prefill_seconds)
            steps += [s * 1e3 for s in out.decode_token_seconds[a.skip:]]
        row = {"block_size": block_size, "ring_slots": slots, "ms_per_token": stats(steps),
               "floor_ms": floor_ms, "over_floor": stats(steps)["median"] / floor_ms, "prefill_s": prefill,
               "step_ms": steps}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_ms"}), flush=True)
        (a.out / "probe_decode_defaults.json").write_text(json.dumps(
            {"meta": run_metadata(), "args": {k: str(v) for k, v in vars(a).items()}, "h2d_bytes_per_s": bandwidth,
             "host_tokens": a.host_tokens, "rows": rows}, indent=1))
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
