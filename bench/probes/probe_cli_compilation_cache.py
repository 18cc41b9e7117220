"""Probe: wall time of `python -m jax_offload.generate` on the default model with and without the CLI's compilation
cache (`bench/results/runs/cpu_compilation_cache/`). One run fills a fresh cache, then 5 runs without a cache and 5
with the filled one, alternated, each its own process.

    python bench/probes/probe_cli_compilation_cache.py OUT.json
"""
import json, subprocess, sys, time, platform, datetime, shutil, os, statistics
import jax
cache = "/tmp/jxo_bench"; shutil.rmtree(cache, ignore_errors=True)
model = os.path.expanduser("~/.cache/jax_offload/SmolLM2-135M-Instruct")
def run(cache_dir):
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jax_offload.generate", "--model", model, "--prompt",
                          "What is the capital of France?", "--compilation-cache-dir", cache_dir],
                         capture_output=True, text=True, check=True).stdout
    return {"wall_s": time.perf_counter() - t, "speed_line": out.strip().splitlines()[-1]}
fill = run(cache)
rows = {"no cache": [], "cache filled by an earlier run": []}
for _ in range(5):  # alternated, so both see the same machine
    rows["no cache"].append(run(""))
    rows["cache filled by an earlier run"].append(run(cache))
summary = {k: {"median_s": statistics.median(r["wall_s"] for r in v), "min_s": min(r["wall_s"] for r in v),
               "max_s": max(r["wall_s"] for r in v), "n": len(v)} for k, v in rows.items()}
meta = {"machine": f"{os.cpu_count()} CPUs, {platform.machine()}", "python": platform.python_version(),
        "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": "SmolLM2-135M-Instruct, float32", "entries_after_fill": len([p for p in os.listdir(cache) if p.endswith("-cache")])}
json.dump({"meta": meta, "fill_run": fill, "summary": summary, "runs": rows}, open(sys.argv[1], "w"), indent=1)
print(json.dumps(summary, indent=1)); print(meta)
