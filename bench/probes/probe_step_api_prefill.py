"""Why a short request to a CPU server takes ~2 s while `LLM.generate` of it takes ~0.3 s (issue 62's lm-eval runs).

In one spawned engine process (`EngineProcess`, as `python -m jax_offload.serve` runs it; the default model, float32,
the server's engine options), a 10-token prompt with max_tokens 1, greedy: `LLM.generate` of it (`engine.call`, 4
times), then the same request through the step API the server uses (`engine.generate`: `add_request` + `step`, 3
times), at each --max-num-seqs of SEQS (default "256,8"). Writes probe_step_api_prefill.json under $OUT.

    OUT=DIR python bench/probes/probe_step_api_prefill.py
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import probe_output, run_metadata  # noqa: E402
from jax_offload import SamplingParams  # noqa: E402
from jax_offload.generate import load_llm  # noqa: E402
from jax_offload.serve import build_parser  # noqa: E402
from jax_offload.serving.async_engine import EngineProcess  # noqa: E402

IDS = [33, 32, 1232, 216, 34, 36, 446, 216, 35, 34]


def timed_generate(llm, ids: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate([ids], params)
    return time.perf_counter() - start


async def measure(engine: EngineProcess) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    generate = [await engine.call(timed_generate, IDS, params) for _ in range(4)]
    step_api = []
    for i in range(3):
        start = time.perf_counter()
        async for _ in engine.generate(f"r{i}", IDS, params):
            pass
        step_api.append(time.perf_counter() - start)
    return {"llm_generate_s": generate, "step_api_s": step_api}


def main() -> None:
    result = {**run_metadata(), "prompt_tokens": len(IDS), "max_tokens": 1, "runs": {}}
    for seqs in os.environ.get("SEQS", "256,8").split(","):
        args = build_parser().parse_args(["--dtype", "float32", "--max-num-seqs", seqs])
        engine = EngineProcess(functools.partial(load_llm, args, True))
        engine.start(warm_up=False)
        try:
            result["runs"][seqs] = asyncio.run(measure(engine))
        finally:
            engine.stop()
        print(seqs, result["runs"][seqs], flush=True)
    probe_output("probe_step_api_prefill.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
