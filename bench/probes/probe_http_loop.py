"""What the HTTP process costs a served run by itself (issue 62): the real app (`create_app`) on uvicorn over a
stand-in engine that gives every running request one token each --step seconds, with `bench_serve.py`'s client
(nano-vllm's 256 token-id prompts, all at once, streamed). No model, no JAX: only the HTTP process's own work.

Per run: wall time, when the stand-in took the first and the last request (from the client's start), the event
loop thread's CPU seconds and that per streamed token, and the garbage collector's pauses in this process by
generation. Arms, in turn run by run: the heap as the server leaves it before it serves (`frozen`:
`freeze_startup_heap`) and not (`unfrozen`). Writes probe_http_loop.json under $OUT. The client needs aiohttp
(`pip install aiohttp`; the GPU machines have it).

    python bench/probes/probe_http_loop.py --runs 4 --step 0.0055 --scale 0.3
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_serve import GcPauses, workload  # noqa: E402
from common import probe_output, run_metadata, stats  # noqa: E402
from jax_offload.outputs import RequestDelta  # noqa: E402
from jax_offload.serving.api_server import create_app, freeze_startup_heap, serve_in_background  # noqa: E402
from jax_offload.serving.async_engine import EngineProcess, ModelInfo, _Front  # noqa: E402


class StandInEngine(EngineProcess):
    """An engine front whose "steps" are a thread giving each running request one token every `step` seconds, its
    deltas handed to the event loop as `EngineProcess`'s reader does. An `EngineProcess` to `create_app`, without
    a process."""

    def __init__(self, step: float):
        _Front.__init__(self, None)
        self.info = ModelInfo(None, 4096, 32000)
        self.step, self.adds = step, []
        self._lock, self._live, self._stopped = threading.Lock(), {}, False
        threading.Thread(target=self._run, daemon=True).start()

    def start(self, warm_up: bool = False) -> None:
        pass

    def stop(self) -> None:
        self._stopped = True

    def _send(self, command: tuple) -> None:
        with self._lock:
            if command[0] == "add":
                self._live[command[1]] = [command[3].max_tokens, 0]
                self.adds.append(time.perf_counter())
            elif command[0] == "abort":
                self._live.pop(command[1], None)

    def _run(self) -> None:
        due = time.perf_counter()
        while not self._stopped:
            due += self.step
            items = []
            with self._lock:
                for request_id, state in list(self._live.items()):
                    state[1] += 1
                    finish = "length" if state[1] >= state[0] else None
                    items.append((request_id, RequestDelta(request_id, [state[1] % 1000], "", [], finish, None)))
                    if finish:
                        del self._live[request_id]
            if items:
                self._deliver(items, None, None)
            time.sleep(max(due - time.perf_counter(), 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=4, help="runs per arm")
    p.add_argument("--step", type=float, default=0.0055, help="seconds between the stand-in's tokens")
    p.add_argument("--scale", type=float, default=0.3, help="each request's max_tokens times this (at least 2)")
    args = p.parse_args()

    engine = StandInEngine(args.step)
    app = create_app(engine, "bench")
    with serve_in_background(app) as (url, loop_thread):
        loop_clock = time.pthread_getcpuclockid(loop_thread.ident)
        prompts, max_tokens = workload("qwen3-0.6b", 256)
        max_tokens = [max(2, int(m * args.scale)) for m in max_tokens]
        spec = probe_output("probe_http_loop_client.json")
        gc_pauses, objects = GcPauses(), len(gc.get_objects())
        runs: dict[str, list[dict]] = {"frozen": [], "unfrozen": []}
        for _ in range(args.runs):
            for arm in runs:
                gc.unfreeze()
                if arm == "frozen":
                    freeze_startup_heap()
                spec.write_text(json.dumps({"url": url, "prompts": prompts,
                                            "max_tokens": max_tokens, "rate": float("inf")}))
                engine.adds.clear()
                gc_pauses.reset()
                cpu = time.clock_gettime(loop_clock)
                subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serve.py"), "--client", str(spec)],
                               check=True)
                cpu = time.clock_gettime(loop_clock) - cpu
                out = json.loads(spec.read_text())
                runs[arm].append({"wall_s": out["wall_s"], "first_request_s": engine.adds[0] - out["began"],
                                  "last_request_s": engine.adds[-1] - out["began"], "loop_cpu_s": cpu,
                                  "loop_us_per_token": cpu / sum(max_tokens) * 1e6, "gc": gc_pauses.report()})
                print(arm, {k: v for k, v in runs[arm][-1].items() if k != "gc"}, flush=True)
    spec.unlink()
    summary = {arm: {key: stats([r[key] for r in rs]) for key in
                     ("wall_s", "first_request_s", "last_request_s", "loop_cpu_s", "loop_us_per_token")}
               | {"full_gc_s": stats([r["gc"]["gen2"]["seconds"] for r in rs])} for arm, rs in runs.items()}
    result = {**run_metadata(), "step_s": args.step, "scale": args.scale, "requests": len(prompts),
              "tokens": sum(max_tokens), "gc_objects_at_start": objects, "summary": summary,
              "runs": runs}
    probe_output("probe_http_loop.json").write_text(json.dumps(result, indent=1))
    for arm, figures in summary.items():
        print(arm, {key: round(figure["median"], 4) for key, figure in figures.items()})


if __name__ == "__main__":
    main()
