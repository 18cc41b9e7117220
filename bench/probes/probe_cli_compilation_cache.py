"""Probe: wall time of `python -m jax_offload.generate` on the default model with and without the CLI's compilation
cache (`bench/results/runs/cpu_compilation_cache/`). One run fills a fresh cache, then 5 runs without a cache and 5
with the filled one, alternated, each its own process.

    python bench/probes/probe_cli_compilation_cache.py OUT.json
"""
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import jax

CACHE = "/tmp/jxo_bench"
MODEL = os.path.expanduser("~/.cache/jax_offload/SmolLM2-135M-Instruct")


def run(cache_dir: str) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jax_offload.generate", "--model", MODEL, "--prompt",
                          "What is the capital of France?", "--compilation-cache-dir", cache_dir],
                         capture_output=True, text=True, check=True).stdout
    return {"wall_s": time.perf_counter() - start, "speed_line": out.strip().splitlines()[-1]}


def main() -> None:
    shutil.rmtree(CACHE, ignore_errors=True)
    fill = run(CACHE)
    rows = {"no cache": [], "cache filled by an earlier run": []}
    for _ in range(5):  # alternated, so both see the same machine
        rows["no cache"].append(run(""))
        rows["cache filled by an earlier run"].append(run(CACHE))
    summary = {k: {"median_s": statistics.median(r["wall_s"] for r in v), "min_s": min(r["wall_s"] for r in v),
                   "max_s": max(r["wall_s"] for r in v), "n": len(v)} for k, v in rows.items()}
    meta = {"machine": f"{os.cpu_count()} CPUs, {platform.machine()}", "python": platform.python_version(),
            "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": "SmolLM2-135M-Instruct, float32",
            "entries_after_fill": len([p for p in os.listdir(CACHE) if p.endswith("-cache")])}
    with open(sys.argv[1], "w") as f:
        json.dump({"meta": meta, "fill_run": fill, "summary": summary, "runs": rows}, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(meta)


if __name__ == "__main__":
    main()
