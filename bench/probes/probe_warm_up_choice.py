"""Which batch sizes does the warm-up give several decode steps a program on this device? For each shape: an LLM of
random bf16 weights (small batch and step budget, so the warm-up is short), `LLM.warm_up()`, and the batch engine's
`multi_step_batch`, with the dispatch and device time it measured at each batch size it timed (`decode_timing`).

    python bench/probes/probe_warm_up_choice.py --shapes qwen3-0.6b,llama-3.1-8b --out DIR   # DIR/warm_up_choice.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax.numpy as jnp  # noqa: E402

from common import model_config, random_params, run_metadata  # noqa: E402
from jax_offload import LLM  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--layers", type=int, help="fewer layers: a quick CPU check")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": run_metadata(), "max_num_seqs": args.max_num_seqs, "shapes": {}}
    for shape in args.shapes.split(","):
        cfg = model_config(shape, args.layers)
        llm = LLM.from_params(cfg, random_params(cfg, jnp.bfloat16), dtype="bfloat16", max_model_len=1024,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024)
        engine = llm.request_engine()
        start = time.perf_counter()
        llm.warm_up()
        timed = {size: {"dispatch_ms": dispatch * 1e3, "device_ms": device * 1e3}
                 for size, (dispatch, device) in engine.decode_timing.items()}
        result["shapes"][shape] = {"multi_step_batch": engine.multi_step_batch, "timed": timed,
                                   "warm_up_s": time.perf_counter() - start}
        print(shape, json.dumps(result["shapes"][shape]), flush=True)
        (args.out / "warm_up_choice.json").write_text(json.dumps(result, indent=1))
        del llm, engine


if __name__ == "__main__":
    main()
