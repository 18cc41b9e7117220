"""Serving benchmark in the style of vLLM's: the OpenAI server (`jax_offload.serving.api_server`) against the
offline `LLM.generate` of the same requests on the same engine, in one process and one call.

nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024, token-id prompts, temperature
0.6 with a seed per request, ignore_eos) on random bf16 weights at a real shape. The server runs in this process
(uvicorn on a thread) with the engine in a process of its own, as `python -m jax_offload.serve` runs it; the
offline runs happen in that engine process too (same engine, same compiled programs); the client is a third
process (aiohttp, streaming /v1/completions). Phases:
  offline   LLM.generate of all requests: a warm-up run, then --runs timed runs (output tok/s)
  single    each of the --rate-requests first prompts alone through LLM.generate, max_tokens 1: the offline TTFT
  inf       all requests sent at once, --runs runs: output tok/s, request/s, TTFT, TPOT, inter-token latency
  rate R    --rate-requests requests with Poisson arrivals at R requests/s: the same figures, and the engine's
            decode step over that run (its step log) beside the TPOT: its median, its median per batch size, and
            the median as the requests saw it (each step once per request in it)
  --without-prefill-behind   then the inf and rate runs again with a new prompt's prefill dispatched only after the
            decode step in flight is read (as before 443180f): `inf_without_prefill_behind`,
            `rates_without_prefill_behind`
  --without-gc-freeze   then the inf runs again with the HTTP process's startup heap given back to the garbage
            collector (`gc.unfreeze`, as before the server froze it): `inf_without_gc_freeze`

    python bench/bench_serve.py --shape qwen3-0.6b --out DIR          # one device call each shape
    python bench/bench_serve.py --shape llama-3.1-8b --out DIR
    python bench/bench_serve.py --shape smoke --out /tmp/serve         # CPU check of the script, < 1 min
    python bench/bench_serve.py --report DIR --out bench/results       # serve.md from the serve_*.json files
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt, model_config, random_params, read_json, result_files, run_metadata, stats  # noqa: E402

from jax_offload.config import EngineConfig  # noqa: E402


def workload(shape: str, num: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draws: prompts of randint(100, 1024) ids in [0, 10000], then max_tokens randint(100, 1024)."""
    random.seed(seed)
    lo, hi, vocab = (8, 48, 1000) if shape == "smoke" else (100, 1024, 10000)
    prompts = [[random.randint(0, vocab) for _ in range(random.randint(lo, hi))] for _ in range(num)]
    return prompts, [random.randint(lo, hi) for _ in range(num)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q / 100 * (len(xs) - 1))), len(xs) - 1)]


# ---- the client (its own process) --------------------------------------------------------------------------------


async def client_run(url: str, prompts: list[list[int]], max_tokens: list[int], rate: float, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    records = [None] * len(prompts)

    async def one(session, i: int, delay: float):
        await asyncio.sleep(delay)
        body = {"model": "bench", "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0.6,
                "seed": i, "ignore_eos": True, "stream": True, "return_token_ids": True}
        sent = time.perf_counter()
        times, tokens = [], []
        async with session.post(url + "/v1/completions", json=body) as r:
            accepted = time.perf_counter()  # the response's headers: the server has handed the request on
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0]["token_ids"]
                if ids:
                    times.append(time.perf_counter())
                    tokens += ids
        records[i] = {"sent": sent, "accepted": accepted, "times": times, "tokens": tokens}

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        began = time.perf_counter()
        await asyncio.gather(*(one(session, i, d) for i, d in enumerate(delays)))
        ended = time.perf_counter()
        wall = ended - began
    ttft = [r["times"][0] - r["sent"] for r in records]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in records if len(r["times"]) > 1]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    out_tokens = sum(len(r["tokens"]) for r in records)
    # perf_counter is CLOCK_MONOTONIC, one clock for the client's and the engine's processes.
    return {"rate": rate, "requests": len(prompts), "began": began, "ended": ended, "wall_s": wall,
            "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall, "request_s": len(prompts) / wall,
            "ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot), "itl_ms": _ms(itl),
            "token_ids": [r["tokens"] for r in records], "accepted": [r["accepted"] for r in records],
            "sent": [r["sent"] for r in records], "first": [r["times"][0] for r in records]}


def _ms(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 50) * 1e3, "p99": percentile(xs, 99) * 1e3, "mean": statistics.mean(xs) * 1e3}


# ---- the server and the offline engine (this process) ------------------------------------------------------------


def build_llm(shape: str, max_model_len: int, num_decode_steps: int = EngineConfig.num_decode_steps,
              num_layers: int | None = None):
    """The engine process's LLM: the shape's random bf16 weights (seed 0, the same in every process); `num_layers`:
    fewer layers (a probe's CPU check)."""
    import jax

    from jax_offload import LLM

    cfg = model_config(shape, num_layers)
    return LLM.from_params(cfg, random_params(cfg, jax.numpy.bfloat16),
                           dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=256,
                           max_num_batched_tokens=16384, num_decode_steps=num_decode_steps)


def _sampling(max_tokens: list[int]):
    from jax_offload import SamplingParams

    return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, seed=i) for i, m in enumerate(max_tokens)]


def _offline(llm, prompts: list[list[int]], max_tokens: list[int], runs: int, single: int) -> dict:
    """In the engine process, between the server's requests: a warm-up run, `runs` timed runs of LLM.generate,
    and the first `single` prompts alone (max_tokens 1, the offline time to first token)."""
    from jax_offload import SamplingParams

    ids = [o.token_ids for o in llm.generate(prompts, _sampling(max_tokens))]
    seconds, ttft, steps = [], [], []
    for _ in range(runs):
        t = time.perf_counter()
        llm.generate(prompts, _sampling(max_tokens))
        seconds.append(time.perf_counter() - t)
        steps.append(_step_counts(llm.request_engine().step_log))
    for p in prompts[:single]:
        t = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=0))
        ttft.append(time.perf_counter() - t)
    return {"meta": run_metadata(), "token_ids": ids, "seconds": seconds, "ttft_s": ttft, "steps": steps}


def _step_counts(log) -> dict:
    """Steps of each kind in an engine's step log: count and seconds (decode: and the median step)."""
    out = {kind: {"count": sum(k == kind for k, *_ in log), "seconds": sum(s for k, _, _, s in log if k == kind)}
           for kind in ("prefill", "chunk", "decode")}
    decode = [s for k, _, _, s in log if k == "decode"]
    out["decode"]["median_ms"] = statistics.median(decode) * 1e3 if decode else None
    return out


def decode_steps_by_rows(log) -> dict:
    """The decode steps of a step log by their rows (running requests): count and median ms per row count, and the
    step as the requests saw it (each step counted once per request in it: `request_weighted_median_ms`)."""
    by_rows: dict[int, list[float]] = {}
    for kind, rows, _, seconds in log:
        if kind == "decode":
            by_rows.setdefault(rows, []).append(seconds * 1e3)
    weighted = sorted((ms, rows) for rows, steps in by_rows.items() for ms in steps)
    half, seen, median = sum(rows for _, rows in weighted) / 2, 0, None
    for ms, rows in weighted:
        seen += rows
        if seen >= half:
            median = ms
            break
    return {"rows": {rows: {"count": len(steps), "median_ms": statistics.median(steps)}
                     for rows, steps in sorted(by_rows.items())}, "request_weighted_median_ms": median}


def _step_log(llm, clear: bool) -> list:
    log = llm.request_engine().step_log
    out = list(log)
    if clear:
        log.clear()
    return out


def _instrument(llm) -> None:
    """Logs when the engine takes each request, and each step call's start, end and prefill seconds (the step log's;
    0 for a call without a prefill): the engine process's side of where a served run's time goes; and the host's
    side of its decode steps and prefills (`host_split`)."""
    llm.bench_events = []
    add_request, step = llm.add_request, llm.step

    def timed_add(*args):
        llm.bench_events.append(("add", time.perf_counter(), 0.0, 0.0))
        add_request(*args)

    def timed_step():
        log = llm.request_engine().step_log
        logged = len(log)
        start = time.perf_counter()
        deltas = step()
        end = time.perf_counter()
        prefill = sum(log[i][3] for i in range(logged, len(log)) if log[i][0] == "prefill")
        llm.bench_events.append(("step", start, end, prefill))
        for delta in deltas:
            if delta.finished and len(delta.output.decode_token_seconds) > 1:
                steps = delta.output.decode_token_seconds
                llm.bench_events.append(("done", sum(steps) / len(steps), 0.0, 0.0))
        return deltas

    llm.add_request, llm.step = timed_add, timed_step
    engine = llm.request_engine()
    decode_async, read, step_due = engine.runner.decode_async, engine._read, engine.step_due
    prefill_async = engine.runner.prefill_async

    def timed_prefill_async(seqs):
        start = time.perf_counter()
        drawn = prefill_async(seqs)
        llm.bench_events.append(("prefill_dispatch", start, time.perf_counter(), len(seqs)))
        return drawn

    def timed_decode_async(seqs, *rest):
        start = time.perf_counter()
        drawn = decode_async(seqs, *rest)
        llm.bench_events.append(("dispatch", start, time.perf_counter(), len(seqs)))
        return drawn

    def timed_read(step, drawn, *rest):
        ready = float(drawn.tokens.is_ready())
        start = time.perf_counter()
        drawn.tokens.block_until_ready()  # as the read would: its wait for the device, apart from taking the draw
        waited = time.perf_counter()
        seconds = read(step, drawn, *rest)
        llm.bench_events.append(("read", start, waited, ready))
        llm.bench_events.append(("take", waited, time.perf_counter(), 0.0))
        return seconds

    def timed_due():
        planned = engine._due
        due = step_due()
        if engine._due is not planned and engine._due is not None and engine._due[1] is not None:
            pending = engine._pending
            llm.bench_events.append(("due", engine._due[1] - max(engine._last_read, pending[2]),
                                     min(engine._decode_seconds), engine._dispatch_seconds))
        return due

    engine.runner.decode_async, engine._read, engine.step_due = timed_decode_async, timed_read, timed_due
    engine.runner.prefill_async = timed_prefill_async  # `prefill` calls it too


def host_split(events: list) -> dict:
    """The engine loop's host side of its decode steps (ms, medians): `decode_async` (dispatch), the read of a step's
    draw (its wait for the device; taking the draw: outputs, detokenizing) and the share of reads that found it
    ready (the device waited for the host), a whole-prompt prefill's dispatch (host time until `prefill_async`
    returns: part of a new request's "waiting"), the time between two step
    calls (taking commands, handing out output, waiting for the step to be due), and `step_due`'s plan: the wait
    from the step's start it planned, the step time it assumed and the dispatch time it allowed for."""
    def ms(xs: list[float]) -> float | None:
        return statistics.median(xs) * 1e3 if xs else None

    dispatch = [b - a for kind, a, b, _ in events if kind == "dispatch"]
    prefill_dispatch = [b - a for kind, a, b, _ in events if kind == "prefill_dispatch"]
    reads = [(b - a, ready) for kind, a, b, ready in events if kind == "read"]
    takes = [b - a for kind, a, b, _ in events if kind == "take"]
    steps = [(a, b) for kind, a, b, _ in events if kind == "step"]
    plans = [(wait, seconds, dispatch_s) for kind, wait, seconds, dispatch_s in events if kind == "due"]
    return {"dispatch": ms(dispatch), "read_wait": ms([r for r, _ in reads]), "take": ms(takes),
            "read_found_ready_share": statistics.mean([ready for _, ready in reads]) if reads else None,
            "step_call": ms([b - a for a, b in steps]),
            "between_step_calls": ms([steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]),
            "prefill_dispatch": ms(prefill_dispatch), "due_plans": len(plans), "due_wait": ms([p[0] for p in plans]),
            "due_step_estimate": ms([p[1] for p in plans]), "due_dispatch_estimate": ms([p[2] for p in plans])}


def _take_events(llm) -> list:
    events, llm.bench_events = llm.bench_events, []
    return events


def _prefill_after_read(llm) -> None:
    """The engine reads the decode step in flight before it dispatches a waiting prompt's prefill (as before
    443180f): the other arm of `BatchEngine._prefill_behind`'s comparison."""
    engine = llm.request_engine()
    engine._prefill_behind = lambda pending, deltas: engine._read(*pending, deltas)


class GcPauses:
    """The garbage collector's pauses in this (the HTTP) process, by generation: count and seconds since `reset`."""

    def __init__(self):
        self.began = 0.0
        self.reset()
        gc.callbacks.append(self._observe)

    def reset(self) -> None:
        self.pauses = {generation: [0, 0.0] for generation in range(3)}

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            pause = self.pauses[info["generation"]]
            pause[0] += 1
            pause[1] += time.perf_counter() - self.began

    def report(self) -> dict:
        return {f"gen{g}": {"count": n, "seconds": s} for g, (n, s) in self.pauses.items()}


def time_budget(client: dict, events: list) -> dict:
    """Where a served run's wall time went, in seconds: before the engine took the first request, while the engine
    ran steps, between its steps (taking commands, handing out output, idle), and after its last step until the
    client read its last token; and over how long the engine took the requests."""
    adds = [t for kind, t, _, _ in events if kind == "add"]
    steps = [(a, b) for kind, a, b, _ in events if kind == "step"]
    busy = sum(b - a for a, b in steps)
    accepted = client["accepted"]
    return {"server_accepted_over": max(accepted) - client["began"], "before_first_request": adds[0] - client["began"],
            "in_steps": busy,
            "between_steps": steps[-1][1] - steps[0][0] - busy, "after_last_step": client["ended"] - steps[-1][1],
            "requests_taken_over": adds[-1] - adds[0]}


def ttft_split(client: dict, events: list) -> dict:
    """Each request's time to first token in four parts (ms: p50 and mean over requests; the means add up to
    TTFT's): in (client, HTTP, the handler, the pipe to the engine: until the engine took it), waiting (for the
    step in flight, and taking commands: until its prefill began), prefill (the step log's), out (the pipe back,
    the event loop, the server-sent event, the client: until the client read the token). Requests are matched to
    the engine's takes in order of sending (Poisson arrivals: each well apart)."""
    adds = sorted(t for kind, t, _, _ in events if kind == "add")
    prefills = [(end, seconds) for kind, _, end, seconds in events if kind == "step" and seconds > 0]
    parts = {"in": [], "waiting": [], "prefill": [], "out": []}
    for sent, first, add in zip(*zip(*sorted(zip(client["sent"], client["first"]))), adds):
        end, seconds = next(p for p in prefills if p[0] > add)
        for name, value in zip(parts, (add - sent, end - seconds - add, seconds, first - end)):
            parts[name].append(value * 1e3)
    return {name: {"p50": percentile(xs, 50), "mean": statistics.mean(xs)} for name, xs in parts.items()}


def run(args) -> None:
    from jax_offload.serving.api_server import create_app, freeze_startup_heap, serve_in_background
    from jax_offload.serving.async_engine import EngineProcess

    prompts, max_tokens = workload(args.shape, args.num_requests)
    # The server's way: the engine in a process of its own, which also runs the offline LLM.generate.
    engine = EngineProcess(functools.partial(build_llm, args.shape, max(map(len, prompts)) + max(max_tokens) + 1,
                                             args.num_decode_steps))
    t = time.perf_counter()
    engine.start(warm_up=True)
    warm_s = time.perf_counter() - t
    offline = asyncio.run(engine.call(_offline, prompts, max_tokens, args.runs, args.rate_requests))
    asyncio.run(engine.call(_instrument))
    result = {"meta": offline["meta"], "shape": args.shape, "num_decode_steps": args.num_decode_steps,
              "requests": len(prompts),
              "input_tokens": sum(map(len, prompts)), "output_tokens": sum(max_tokens), "warmup_s": warm_s,
              "offline": {"seconds": stats(offline["seconds"]),
                          "output_tok_s": stats([sum(max_tokens) / s for s in offline["seconds"]]),
                          "engine_steps": offline["steps"]},
              "offline_ttft_ms": stats([s * 1e3 for s in offline["ttft_s"]])}

    app = create_app(engine, "bench")
    freeze_startup_heap()  # as `python -m jax_offload.serve` does before it serves
    gc_pauses = GcPauses()
    with serve_in_background(app) as (url, _):

        def client(rate: float, num: int) -> dict:
            spec = Path(args.out) / "client_spec.json"
            spec.write_text(json.dumps({"url": url, "prompts": prompts[:num], "max_tokens": max_tokens[:num],
                                        "rate": rate}))
            asyncio.run(engine.call(_step_log, True))
            asyncio.run(engine.call(_take_events))
            gc_pauses.reset()
            subprocess.run([sys.executable, __file__, "--client", str(spec)], check=True)
            out = json.loads(spec.read_text())
            log = asyncio.run(engine.call(_step_log, False))
            events = asyncio.run(engine.call(_take_events))
            out["time_budget_s"] = time_budget(out, events)
            out["http_gc_pauses"] = gc_pauses.report()
            # Each request's mean decode step, over the steps it took part in (its batches): the engine's side of TPOT.
            out["request_step_ms"] = _ms([s for kind, s, _, _ in events if kind == "done"])
            out["host_split_ms"] = host_split(events)
            if rate != float("inf"):
                out["ttft_split_ms"] = ttft_split(out, events)
            for key in ("accepted", "sent", "first"):
                del out[key]
            decode = [s for kind, _, _, s in log if kind == "decode"]
            out["decode_step_ms"] = stats([s * 1e3 for s in decode]) if decode else None
            out["decode_step_ms_by_rows"] = decode_steps_by_rows(log)
            out["engine_steps"] = _step_counts(log)
            out["same_tokens_as_offline"] = sum(a == b for a, b in zip(out.pop("token_ids"), offline["token_ids"]))
            return out

        def save() -> None:  # after each phase: a call cut short keeps what it measured
            (args.out / f"serve_{args.shape}.json").write_text(json.dumps(result, indent=1))

        save()
        client(float("inf"), len(prompts))  # warm-ups: the client's first connections, the small batches' shapes
        client(16.0, args.rate_requests)
        result["inf"] = [client(float("inf"), len(prompts)) for _ in range(args.runs)]
        save()
        result["rates"] = []
        for rate in args.rates:
            result["rates"].append(client(rate, args.rate_requests))
            save()
        if args.without_prefill_behind:
            asyncio.run(engine.call(_prefill_after_read))
            result["inf_without_prefill_behind"] = [client(float("inf"), len(prompts)) for _ in range(args.runs)]
            result["rates_without_prefill_behind"] = [client(rate, args.rate_requests) for rate in args.rates]
            save()
        if args.without_gc_freeze:
            gc.unfreeze()
            result["inf_without_gc_freeze"] = [client(float("inf"), len(prompts)) for _ in range(args.runs)]
            save()
    engine.stop()


def report(folder: Path, out: Path) -> None:
    lines = ["# Serving: the OpenAI server against offline `LLM.generate`", ""]
    for path in result_files(folder, "serve_*.json"):
        r = read_json(path)
        m = r["meta"]
        inf = r["inf"]
        served = stats([x["output_tok_s"] for x in inf])
        ratio = served["median"] / r["offline"]["output_tok_s"]["median"]
        lines += [f"## {r['shape']}: {m['device']}, jax {m['jax']}, {m['date']} ([{path.name}]({path.name}))", "",
                  f"nano-vllm's workload: {r['requests']} requests, {r['input_tokens']} prompt and "
                  f"{r['output_tokens']} output tokens; medians of {len(inf)} runs (min-max)."
                  + (f" num_decode_steps {r['num_decode_steps']}." if "num_decode_steps" in r else ""), "",
                  "| what | figure |", "|---|---|",
                  f"| offline output tok/s | {fmt(r['offline']['output_tok_s'], digits=0)} |",
                  f"| server output tok/s, infinite rate | {fmt(served, digits=0)} (**{ratio:.3f}x** offline) |",
                  f"| server request/s, infinite rate | {fmt(stats([x['request_s'] for x in inf]))} |",
                  *_without_rows(r),
                  f"| offline single-request TTFT ms | {fmt(r['offline_ttft_ms'], digits=1)} |", "",
                  "| rate req/s | requests | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms "
                  "| engine decode step ms | each request's engine step ms, p50 (TPOT p50 / it) "
                  "| same tokens as offline |",
                  "|---|---|---|---|---|---|---|---|---|"]
        rated = [(str(x["rate"]), x) for x in r["rates"]] + \
            [(f"{x['rate']}, prefill after the read", x) for x in r.get("rates_without_prefill_behind", [])]
        for label, x in [(str(inf[0]["rate"]), inf[0]), *rated]:
            step = fmt(x["decode_step_ms"], digits=2) if x.get("decode_step_ms") else "-"
            if (x.get("decode_step_ms_by_rows") or {}).get("request_weighted_median_ms") is not None:
                step += f"; as its requests saw it {x['decode_step_ms_by_rows']['request_weighted_median_ms']:.2f}"
            own = x.get("request_step_ms")
            own = f"{own['p50']:.2f} ({x['tpot_ms']['p50'] / own['p50']:.3f}x)" if own else "-"
            lines.append(f"| {label} | {x['requests']} | {x['output_tok_s']:.0f} | {x['ttft_ms']['p50']:.1f} / "
                         f"{x['ttft_ms']['p99']:.1f} | {x['tpot_ms']['p50']:.2f} / {x['tpot_ms']['p99']:.2f} | "
                         f"{x['itl_ms']['p50']:.2f} / {x['itl_ms']['p99']:.2f} | {step} | {own} | "
                         f"{x['same_tokens_as_offline']} / {x['requests']} |")
        lines.append("")
        if "ttft_split_ms" in r["rates"][0]:
            lines += ["Each request's time to first token in parts, ms, p50 / mean over the requests (the means add up "
                      "to the mean TTFT): in (client, HTTP, handler, pipe: until the engine took it), waiting (for the "
                      "step in flight: until its prefill began), prefill, out (pipe, event loop, server-sent event, "
                      "client):", "", "| rate req/s | in | waiting | prefill | out | TTFT mean |",
                      "|---|---|---|---|---|---|"]
            for label, x in rated:
                split = x["ttft_split_ms"]
                lines.append(f"| {label} | " + " | ".join(f"{split[k]['p50']:.2f} / {split[k]['mean']:.2f}"
                                                             for k in split) + f" | {x['ttft_ms']['mean']:.2f} |")
            lines.append("")
        if "time_budget_s" in inf[0]:
            lines += _budget_table(r)
    out.write_text("\n".join(lines))


def _without_rows(r: dict) -> list[str]:
    """The infinite-rate output tok/s of the A/B runs: each prefill dispatched after the decode step in flight is
    read; the HTTP process's heap unfrozen."""
    rows = []
    for key, label in (("inf_without_prefill_behind", "prefill after the read"),
                       ("inf_without_gc_freeze", "HTTP heap not frozen")):
        if r.get(key):
            served = stats([x["output_tok_s"] for x in r[key]])
            ratio = served["median"] / r["offline"]["output_tok_s"]["median"]
            rows.append(f"| server output tok/s, infinite rate, {label} | {fmt(served, digits=0)} "
                        f"(**{ratio:.3f}x** offline) |")
    return rows


def _budget_table(r: dict) -> list[str]:
    """Where the infinite-rate runs' time went against offline: medians over the runs (min-max)."""
    inf, offline = r["inf"], r["offline"]

    def row(what: str, served: list[float], off: list[float] | None, digits: int = 3) -> str:
        return f"| {what} | {fmt(stats(served), digits=digits)} | {fmt(stats(off), digits=digits) if off else '-'} |"

    budget = {k: [x["time_budget_s"][k] for x in inf] for k in inf[0]["time_budget_s"]}
    steps = [x["engine_steps"] for x in inf]
    off_steps = offline["engine_steps"]
    lines = ["Where the infinite-rate time goes (seconds unless named; the engine's side from its own clock):", "",
            "| what | server | offline |", "|---|---|---|",
            row("wall", [x["wall_s"] for x in inf], [offline["seconds"]["median"]]),
            row("until the server's last response headers (it handed the request on)",
                budget["server_accepted_over"], None) if "server_accepted_over" in budget else None,
            row("before the engine took the first request", budget["before_first_request"], None),
            row("requests taken over", budget["requests_taken_over"], None),
            row("in engine steps", budget["in_steps"], None),
            row("between engine steps (commands, output, idle)", budget["between_steps"], None),
            row("after the last step until the client's last token", budget["after_last_step"], None),
            row("prefill steps", [x["prefill"]["count"] for x in steps], [x["prefill"]["count"] for x in off_steps], 0),
            row("prefill seconds", [x["prefill"]["seconds"] for x in steps],
                [x["prefill"]["seconds"] for x in off_steps]),
            row("decode steps", [x["decode"]["count"] for x in steps], [x["decode"]["count"] for x in off_steps], 0),
            row("decode step ms (median)", [x["decode"]["median_ms"] for x in steps],
                [x["decode"]["median_ms"] for x in off_steps], 2),
            row("the HTTP process's full garbage collections (seconds)",
                [x["http_gc_pauses"]["gen2"]["seconds"] for x in inf], None) if "http_gc_pauses" in inf[0] else None,
            ""]
    return [line for line in lines if line is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--out", type=Path, required=False)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--num-decode-steps", type=int, default=EngineConfig.num_decode_steps,
                   help="the engine's num_decode_steps (server and offline)")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 4.0, 16.0])
    p.add_argument("--rate-requests", type=int, default=32)
    p.add_argument("--without-prefill-behind", action="store_true",
                   help="then the rate runs again, each prefill dispatched after the decode step in flight is read")
    p.add_argument("--without-gc-freeze", action="store_true",
                   help="then the infinite-rate runs again with the HTTP process's heap unfrozen")
    p.add_argument("--client", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path)
    args = p.parse_args()
    if args.client:
        spec = json.loads(args.client.read_text())
        args.client.write_text(json.dumps(asyncio.run(client_run(spec["url"], spec["prompts"], spec["max_tokens"],
                                                                 spec["rate"], seed=0))))
        return
    if args.report:
        report(args.report, args.out / "serve.md")
        return
    if args.shape == "smoke":
        args.num_requests, args.runs, args.rate_requests = 16, 2, 4
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
