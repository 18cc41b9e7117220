"""Continuous-batching throughput on one GPU, nano-vllm's benchmark: 256 requests, prompt and output lengths
uniform in 100..1024 (Python's random, seed 0, nano-vllm's draw order), temperature 0.6, ignore_eos; random bf16
weights at a real shape.

Phases, each in a fresh process writing phase_<phase>_<shape>.json under --out:
  ours    LLM.generate of all requests (continuous batching): a full warm-up run of the same workload (every
          padded shape compiled), then --runs timed runs: output tokens/s; each decode step's time against its
          HBM floor (weights read + KV bytes read) / measured device read bandwidth
  hf      transformers' own continuous batching (init_continuous_batching + add_request with each request's
          max_new_tokens), warmed up on the same workload, --hf-runs timed runs
  batch1  batch 1, KV in GPU memory, --batch1-context tokens (8K): per-token decode time against the HBM floor
          (8B shape unless --shape smoke), through LLM.generate (the batch engine)
  offload offload=True, --offload-requests prompts of --offload-context tokens (8B shape unless --shape smoke),
          --offload-tokens new tokens each: the same requests one after another and together (continuous
          batching over the host store), output tokens/s of both; each batched decode step against its PCIe
          floor (KV bytes of every running request / measured host-to-GPU bandwidth); --offload-decode-policy
          (sketch, quest) and --offload-kv-cache-dtype (int8, fp8) run it with a page policy or 8-bit KV (no floor)

    python bench/bench_throughput.py --shapes qwen3-0.6b --phases ours,hf --out DIR         # one device call
    python bench/bench_throughput.py --shapes llama-3.1-8b --phases ours,hf,batch1 --runs 3 --out DIR
    python bench/bench_throughput.py --shapes llama-3.1-8b --phases offload --out DIR
    python bench/bench_throughput.py --shapes llama-3.1-8b --phases offload --offload-context 65536 \
        --offload-decode-policy sketch --offload-kv-cache-dtype int8 --offload-block-size 4096 --runs 0 \
        --out DIR                                                   # 8 x 64K, sketch: decode steps only
    (add --offload-sparse-cache-gb 4.5 for a page cache: 9 regions of twice the budget at int8)
    python bench/bench_throughput.py --shape smoke --out /tmp/tp                             # CPU check, < 1 min
    --no-batch-invariant runs without the engine's batch-invariant mode (on by default); the mode's phase files end
    in _batch_invariant.json
    python bench/bench_throughput.py --report DIR --out bench/results            # throughput.md and .png
"""
from __future__ import annotations

import argparse
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

from common import (  # noqa: E402
    SHAPES, GiB, RandomModel, add_batch_invariant_option, fmt, h2d_bandwidth, run_metadata, stats,
)

from jax_offload.config import EngineConfig  # noqa: E402

PHASES = ("ours", "hf", "batch1", "offload")
BATCH1_SHAPE = "llama-3.1-8b"


def workload(args, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py draws (with seed 0): prompts of randint(100, 1024) ids in [0, 10000], then max_tokens
    randint(100, 1024) each (smaller with --shape smoke)."""
    random.seed(seed)
    lo, hi, vocab = (8, 48, 1000) if args.shape == "smoke" else (100, 1024, 10000)
    prompts = [[random.randint(0, vocab) for _ in range(random.randint(lo, hi))] for _ in range(args.num_seqs)]
    max_tokens = [random.randint(lo, hi) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def read_bandwidth(nbytes: int) -> dict:
    """Device memory read bandwidth, bytes/s: a jitted float32 sum over `nbytes` of bf16 (a decode step mostly
    reads), each sample the mean of 5 back-to-back calls waited for once, 9 samples after a warm-up."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    total(x).block_until_ready()
    rates = []
    for _ in range(9):
        t = time.perf_counter()
        jax.block_until_ready([total(x) for _ in range(5)])
        rates.append(5 * nbytes / (time.perf_counter() - t))
    return stats(rates)


def weight_bytes_read(params) -> int:
    """Bytes a decode step reads of the weights: all but an untied embedding table (only its rows are read)."""
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - (params.embed.nbytes if params.lm_head is not None else 0)


def phase_ours(args) -> dict:
    from jax_offload import SamplingParams

    m = RandomModel(args.shape, batch_invariant=args.batch_invariant)
    cfg, params = m.cfg, m.params
    bw = read_bandwidth(2 * GiB if args.shape != "smoke" else 2**24)
    # --distinct-runs: every run draws its own prompts (seed = run number), each run once untimed first (their
    # shapes compiled); with prefix caching the cache is emptied before each timed run, so that it finds nothing
    # and both settings do the same work, caching's bookkeeping included.
    draws = [workload(args, i + 1 if args.distinct_runs else 0) for i in range(args.runs)]
    longest = max(len(p) + m for ps, ms in draws for p, m in zip(ps, ms))
    llm = m.llm(max_model_len=longest + 1, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching,
                num_decode_steps=args.num_decode_steps)

    def sampling(max_tokens):
        return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, seed=i) for i, m in enumerate(max_tokens)]

    t = time.perf_counter()
    for prompts, max_tokens in draws if args.distinct_runs else draws[:1]:
        llm.generate(prompts, sampling(max_tokens))
    warm_s = time.perf_counter() - t
    seconds, tokens = [], 0
    for prompts, max_tokens in draws:
        if args.enable_prefix_caching:
            llm._batch_engine.blocks.forget_cached()
        sps = sampling(max_tokens)
        t = time.perf_counter()
        outs = llm.generate(prompts, sps)
        seconds.append(time.perf_counter() - t)
        tokens = sum(len(o.token_ids) for o in outs)
    engine = llm._batch_engine
    w_bytes, kv_tok = weight_bytes_read(params), cfg.kv_bytes_per_token
    decode = [(n, kv, s) for kind, n, kv, s in engine.step_log if kind == "decode"]
    floors = [(w_bytes + kv * kv_tok) / bw["median"] for _, kv, _ in decode]
    ratios = [s / f for (_, _, s), f in zip(decode, floors)]
    full = [r for (n, _, _), r in zip(decode, ratios) if n >= args.max_num_seqs // 2]
    return {
        "shape": args.shape, "requests": len(prompts), "output_tokens": tokens,
        "input_tokens": sum(map(len, prompts)), "warmup_seconds": warm_s, "seconds": stats(seconds),
        "output_tokens_per_second": stats([tokens / s for s in seconds]),
        "read_bandwidth": bw, "weights_read_GiB": w_bytes / GiB, "kv_bytes_per_token": kv_tok,
        "num_kv_blocks": engine.blocks.num_blocks, "kv_block_size": engine.blocks.block_size,
        "preemptions": engine.stats.preemptions, "swap_outs": engine.stats.swap_outs,
        "recomputes": engine.stats.recomputes,
        "decode_steps": len(decode), "prefill_steps": sum(k == "prefill" for k, *_ in engine.step_log),
        "last_run_seconds": seconds[-1],
        "prefill_seconds_total": sum(s for kind, *_, s in engine.step_log if kind == "prefill"),
        "decode_seconds_total": sum(s for *_, s in decode),
        "decode_step_seconds": stats([s for *_, s in decode]),
        "decode_step_floor_ratio": stats(ratios),
        "decode_step_floor_ratio_large_batch": stats(full) if full else None,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching, "distinct_runs": args.distinct_runs,
        "cached_tokens_last_run": sum(o.num_cached_tokens for o in outs),
    }


def phase_batch1(args) -> dict:
    from jax_offload import SamplingParams

    shape = "smoke" if args.shape == "smoke" else BATCH1_SHAPE
    ctx = 512 if args.shape == "smoke" else args.batch1_context
    m = RandomModel(shape, batch_invariant=args.batch_invariant)
    cfg, params = m.cfg, m.params
    bw = read_bandwidth(2 * GiB if args.shape != "smoke" else 2**24)
    llm = m.llm(max_model_len=ctx + 64, max_num_batched_tokens=args.max_num_batched_tokens)
    prompt = random.Random(1).choices(range(1000), k=ctx)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def median_step(out) -> float:
        return sorted(out.decode_token_seconds)[15]  # median of 31 steps

    llm.generate(prompt, sp)  # the path a single prompt takes: the batch engine (chunks past the step budget)
    batched = [llm.generate(prompt, sp)[0] for _ in range(args.runs)]
    per_token = [median_step(o) for o in batched]
    floor = (weight_bytes_read(params) + ctx * cfg.kv_bytes_per_token) / bw["median"]
    return {"shape": shape, "context": ctx, "decode_token_seconds": stats(per_token), "floor_seconds": floor,
            "floor_ratio": stats([s / floor for s in per_token]), "read_bandwidth": bw, "path": "batch engine",
            "max_num_batched_tokens": llm.engine_config.max_num_batched_tokens,
            "prefill_seconds": stats([o.prefill_seconds for o in batched])}


def phase_offload(args) -> dict:
    from jax_offload import SamplingParams

    shape = "smoke" if args.shape == "smoke" else BATCH1_SHAPE
    ctx, n = (256, 4) if args.shape == "smoke" else (args.offload_context, args.offload_requests)
    m = RandomModel(shape, batch_invariant=args.batch_invariant)
    cfg = m.cfg
    rng = random.Random(2)
    prompts = [rng.choices(range(1000), k=ctx) for _ in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.offload_tokens, ignore_eos=True)
    bs = 64 if args.shape == "smoke" else args.offload_block_size
    policy = {"decode_policy": args.offload_decode_policy, "kv_cache_dtype": args.offload_kv_cache_dtype}
    if args.offload_sparse_cache_gb:
        policy["sparse_cache_gb"] = args.offload_sparse_cache_gb
    per_request = ctx + args.offload_tokens + bs
    llm = m.llm(max_model_len=per_request, host_kv_tokens=n * per_request, offload=True, block_size=bs,
                max_num_seqs=n, **policy)
    start = time.perf_counter()
    llm.generate(prompts, sp)  # warm-up: every step shape compiled, batched and alone
    print(f"offload: {n} requests together (warm-up) in {time.perf_counter() - start:.0f} s", flush=True)
    # Decode steps of one request alone (the one-request path where the engine sends it there): the warm-up's and
    # every timed alone request's.
    alone_steps = list(llm.generate(prompts[:1], sp)[0].decode_token_seconds)
    print(f"offload: one request alone (warm-up) done at {time.perf_counter() - start:.0f} s", flush=True)
    together, alone = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        llm.generate(prompts, sp)
        together.append(time.perf_counter() - t)
        t = time.perf_counter()
        for prompt in prompts:
            alone_steps += llm.generate([prompt], sp)[0].decode_token_seconds
        alone.append(time.perf_counter() - t)
    engine = llm._batch_engine
    bw = h2d_bandwidth(GiB if args.shape != "smoke" else 2**24)
    # Equal prompts and max_tokens: every request is prefilled before the first decode step, then all decode in
    # lockstep, each at kv / n tokens with its stored (full) blocks streamed.
    full = [(kv, s) for kind, b, kv, s in engine.step_log if kind == "decode" and b == n]
    # Full decode's floor (every stored block over PCIe, model-dtype KV); none for a page policy or 8-bit KV.
    floors = [n * ((kv // n - 1) // bs * bs) * cfg.kv_bytes_per_token / bw["median"] for kv, _ in full] \
        if policy == {"decode_policy": "full", "kv_cache_dtype": "auto"} else []
    tokens = n * args.offload_tokens
    end_to_end = {"together_seconds": stats(together), "alone_seconds": stats(alone),
                  "together_tokens_per_second": stats([tokens / s for s in together]),
                  "alone_tokens_per_second": stats([tokens / s for s in alone]),
                  "speedup": stats([a / t for a, t in zip(alone, together)])} if together else {}
    return {"shape": shape, "requests": n, "context": ctx, "new_tokens": args.offload_tokens, "block_size": bs,
            **policy, **end_to_end,
            # Decode alone: output tok/s of steps of one request and of steps of all n together, and their ratio.
            "decode_together_tokens_per_second": stats([n / s for _, s in full]),
            "decode_alone_tokens_per_second": stats([1 / s for s in alone_steps]),
            "decode_speedup": statistics.median(n / s for _, s in full) * statistics.median(alone_steps),
            "full_batch_step_seconds": stats([s for _, s in full]),
            "full_batch_step_pcie_floor_ratio": stats([s / f for (_, s), f in zip(full, floors)]) if floors else None,
            # With a page cache: of the pages the last step (alone) chose, the share already cached.
            "page_cache_hit_rate": llm._runner.page_cache.hit_rate() if llm._runner.page_cache else None,
            "h2d_bandwidth": bw}


HF_SCRIPT = r"""
import json, sys, time, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
raw, prompts, max_tokens, runs = json.loads(sys.stdin.read())
config = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"})
config.eos_token_id = None
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, max_new_tokens=max(max_tokens), eos_token_id=None,
                       pad_token_id=0)

def manager_run(ps, ms):
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    for i, (p, m) in enumerate(zip(ps, ms)):
        manager.add_request(p, request_id=str(i), max_new_tokens=m)
    tokens = 0
    for _ in ps:
        out = manager.get_result(timeout=600)
        tokens += len(out.generated_tokens)
    manager.stop(block=True)
    return tokens

manager_run(prompts, max_tokens)  # the warm-up: the whole workload, as ours
seconds, tokens = [], 0
for _ in range(runs):
    torch.cuda.synchronize(); t = time.perf_counter()
    tokens = manager_run(prompts, max_tokens)
    torch.cuda.synchronize(); seconds.append(time.perf_counter() - t)
print(json.dumps({"api": "init_continuous_batching + add_request", "seconds": seconds, "output_tokens": tokens, "requests": len(prompts),
                  "transformers": transformers.__version__}))
"""


def phase_hf(args) -> dict:
    prompts, max_tokens = workload(args)
    payload = json.dumps([dict(SHAPES[args.shape]), prompts, max_tokens, args.hf_runs])
    run = subprocess.run([sys.executable, "-c", HF_SCRIPT], input=payload, capture_output=True, text=True)
    if run.returncode:
        return {"shape": args.shape, "error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "?",
                "stderr_tail": run.stderr[-3000:]}
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return {"shape": args.shape, **out, "seconds": stats(out["seconds"]),
            "output_tokens_per_second": stats([out["output_tokens"] / s for s in out["seconds"]])}


def run_phase(args) -> None:
    from common import gpu_memory

    result = {"ours": phase_ours, "hf": phase_hf, "batch1": phase_batch1, "offload": phase_offload}[args.run_phase](args)
    if args.run_phase != "hf":
        result["gpu_memory"] = gpu_memory()
    result["meta"] = run_metadata()
    result["batch_invariant"] = args.batch_invariant
    result["num_decode_steps"] = args.num_decode_steps
    # A smaller workload (--num-seqs) gets its own file, compared only with the peer's run of the same one.
    count = f"_n{args.num_seqs}" if args.run_phase in ("ours", "hf") and args.num_seqs != 256 else ""
    mode = "_batch_invariant" if args.batch_invariant and args.run_phase != "hf" else ""
    mode += "_distinct" * args.distinct_runs + "_prefix_caching" * args.enable_prefix_caching
    mode += f"_steps{args.num_decode_steps}" * (args.num_decode_steps > 1 and args.run_phase == "ours")
    path = Path(args.out) / f"phase_{args.run_phase}_{args.shape}{count}{mode}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def _bandwidth(phase: dict) -> str:
    if "read_bandwidth" in phase:
        return f"read bandwidth {phase['read_bandwidth']['median'] / 1e9:.0f} GB/s"
    return f"copy bandwidth {phase['copy_bandwidth']['median'] / 1e9:.0f} GB/s"


def report(srcs: list[Path], out: Path) -> None:
    """throughput.md from the phase files of `srcs`; a later folder's file replaces an earlier one's of the same
    name (a newer run of the same phase, shape and request count)."""
    paths = {p.name: p for src in srcs for p in sorted(src.glob("phase_*.json"))}
    phases = {name[len("phase_"):-len(".json")]: json.loads(p.read_text()) for name, p in sorted(paths.items())}
    metas = [p["meta"] for p in phases.values()]
    meta = metas[0] if metas else {}
    dates = sorted(m.get("date", "") for m in metas)
    when = dates[0] if len(set(d[:10] for d in dates)) <= 1 else f"{dates[0]} to {dates[-1]}"
    lines = ["# Continuous-batching throughput (nano-vllm's benchmark)", "",
             f"{meta.get('device')}, jax {meta.get('jax')}, torch {meta.get('torch')}, transformers "
             f"{meta.get('transformers')}, {when}. Random bf16 weights; nano-vllm's workload (256 "
             "requests, or as many as the column says, drawn the same way): input and output lengths uniform in 100..1024 "
             "(seed 0), temperature 0.6, ignore_eos. Timings: median (min-max) of the runs after a warm-up of the "
             "same workload; the ratio compares the two engines on the same requests.", "",
             "| shape | requests | ours output tok/s | transformers output tok/s | ratio | ours decode step / HBM "
             "floor (all steps; batch >= max/2) | preemptions | runs (ours / transformers) |", "|---|---|---|---|---|---|---|---|"]
    peers = {(p["shape"], p.get("requests")): p for k, p in phases.items() if k.startswith("hf_")}
    for key, ours in phases.items():
        if not key.startswith("ours_"):
            continue
        hf = peers.get((ours["shape"], ours["requests"]), {})
        ratio = (ours["output_tokens_per_second"]["median"] / hf["output_tokens_per_second"]["median"]
                 if "output_tokens_per_second" in hf else None)
        large = ours.get("decode_step_floor_ratio_large_batch")
        lines.append(
            f"| {ours['shape']} | {ours['requests']} | {fmt(ours['output_tokens_per_second'], digits=0)} | "
            f"{fmt(hf.get('output_tokens_per_second'), digits=0) if 'error' not in hf else 'failed: ' + hf['error']} | "
            f"{f'{ratio:.1f}x' if ratio else '-'} | {fmt(ours['decode_step_floor_ratio'])}; {fmt(large)} | "
            f"{ours['preemptions']} | {ours['output_tokens_per_second']['n']}"
            f"{' / ' + str(hf['output_tokens_per_second']['n']) if 'output_tokens_per_second' in hf else ''} |")
    for key, ours in phases.items():
        if key.startswith("ours_") and "prefill_seconds_total" in ours:
            lines += ["", f"Where the last run of {ours['shape']}, {ours['requests']} requests went: "
                      f"{ours['last_run_seconds']:.2f} s, of which prefill {ours['prefill_seconds_total']:.2f} s "
                      f"({ours['prefill_steps']} steps) and decode {ours['decode_seconds_total']:.2f} s "
                      f"({ours['decode_steps']} steps)."]
    for key, b in phases.items():
        if key.startswith("batch1_"):
            lines += ["", f"Batch 1, KV in GPU memory, {b['shape']} at {b['context']} tokens: "
                      f"{fmt(b['decode_token_seconds'], 1e3)} ms/token, HBM floor {b['floor_seconds'] * 1e3:.2f} ms "
                      f"(ratio {fmt(b['floor_ratio'])}; {_bandwidth(b)})" + (
                          f"; the same request through the batch engine (paged pool, one compiled step for the "
                          f"whole model): {fmt(b['batch_engine_decode_token_seconds'], 1e3)} ms/token (ratio "
                          f"{fmt(b['batch_engine_floor_ratio'])})" if "batch_engine_floor_ratio" in b else "") + (
                          f" through LLM.generate, which runs it on the batch engine (paged pool, one compiled step "
                          f"for the whole model); the per-request path (one call per layer): "
                          f"{fmt(b['per_request_decode_token_seconds'], 1e3)} ms/token (ratio "
                          f"{fmt(b['per_request_floor_ratio'])})" if "per_request_floor_ratio" in b else "") + (
                          f". Prefill: {fmt(b['prefill_seconds'])} s on the batch engine (step budget "
                          f"{b['max_num_batched_tokens']} tokens)" if "prefill_seconds" in b else "") + (
                          f", {fmt(b['per_request_prefill_seconds'])} s on the per-request path"
                          if "per_request_prefill_seconds" in b else "") + "."]
    for key, o in phases.items():
        if key.startswith("offload_"):
            policy = f"{o.get('decode_policy', 'full')} decode, KV {o.get('kv_cache_dtype', 'auto')}"
            end_to_end = (f"together {fmt(o['together_tokens_per_second'], digits=1)} output tok/s, one after "
                          f"another {fmt(o['alone_tokens_per_second'], digits=1)} (speedup {fmt(o['speedup'])}); "
                          if "speedup" in o else "")
            decode = (f"decode steps alone: together {fmt(o['decode_together_tokens_per_second'], digits=1)} tok/s, "
                      f"one request {fmt(o['decode_alone_tokens_per_second'], digits=1)} (speedup "
                      f"{o['decode_speedup']:.2f}); " if "decode_speedup" in o else "")
            lines += ["", f"Offloaded KV, {o['shape']}, {o['requests']} requests of {o['context']} tokens, "
                      f"{o['new_tokens']} new tokens each (block {o['block_size']}, {policy}): {end_to_end}{decode}"
                      f"a decode step of all {o['requests']}: {fmt(o['full_batch_step_seconds'], 1e3)} ms"
                      + (f", {fmt(o['full_batch_step_pcie_floor_ratio'])}x its PCIe floor (stored KV of every request "
                         f"/ {o['h2d_bandwidth']['median'] / 1e9:.1f} GB/s host-to-GPU)"
                         if o["full_batch_step_pcie_floor_ratio"] else "") + "."]
    hf_apis = {p.get("api") for k, p in phases.items() if k.startswith("hf_") and "api" in p}
    lines += ["", "HBM floor of a decode step: (weights read + KV bytes of every running request) / the device's "
              "measured read bandwidth (`read_bandwidth` in the phase file, a jitted sum over 2 GiB; older files measured an "
              "elementwise copy, `copy_bandwidth`). transformers API: " + ", ".join(sorted(hf_apis)) + ".",
              "Phase files: " + ", ".join(str(p) for p in paths.values()) + "."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import plots

    plots.throughput(srcs, out / "throughput.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    p.add_argument("--shape", help="one shape (smoke: a tiny Llama and workload for a CPU check)")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hf-runs", type=int, default=5)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization)
    p.add_argument("--num-decode-steps", type=int, default=EngineConfig.num_decode_steps,
                   help="ours: decode steps a program runs (the phase file ends in _steps N when N > 1)")
    p.add_argument("--batch1-context", type=int, default=8192)
    p.add_argument("--offload-context", type=int, default=8192)
    p.add_argument("--offload-requests", type=int, default=8)
    p.add_argument("--offload-block-size", type=int, default=1024,
                   help="offload phase: tokens per KV block (1024; the engine's default is 4096)")
    p.add_argument("--offload-tokens", type=int, default=32)
    p.add_argument("--offload-decode-policy", default="full", help="offload phase: full, sketch or quest")
    p.add_argument("--offload-kv-cache-dtype", default="auto", help="offload phase: auto, fp8 or int8")
    p.add_argument("--offload-sparse-cache-gb", type=float, default=0.0,
                   help="offload phase, sketch or quest: GiB of page cache (regions of twice the budget per request)")
    add_batch_invariant_option(p)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="phase ours: the engine's prefix caching")
    p.add_argument("--distinct-runs", action=argparse.BooleanOptionalAction, default=False,
                   help="phase ours: each run draws its own prompts (seed = run number) instead of repeating seed 0's")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/runs/throughput"))
    p.add_argument("--report", type=Path, nargs="+", metavar="DIR",
                   help="write throughput.md from the phase files in these folders (later ones replace earlier)")
    p.add_argument("--run-phase", choices=PHASES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.report:
        return report(args.report, Path(args.out))
    if args.run_phase:
        return run_phase(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    shapes = [args.shape] if args.shape else args.shapes.split(",")
    phases = [x for x in args.phases.split(",") if x]
    bad = [x for x in phases if x not in PHASES] + [s for s in shapes if s not in SHAPES]
    if bad:
        p.error(f"unknown phase or shape {bad[0]!r}; phases: {', '.join(PHASES)}; shapes: {', '.join(SHAPES)}")
    if shapes == ["smoke"]:
        phases = [x for x in phases if x != "hf"]  # transformers' continuous batching needs CUDA
        extra = ["--num-seqs", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--runs", "1"]
    else:
        extra = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                 ("runs", "hf_runs", "num_seqs", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                  "batch1_context", "offload_context", "offload_requests", "offload_tokens", "offload_block_size")]
    extra += ["--batch-invariant" if args.batch_invariant else "--no-batch-invariant",
              "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
              "--distinct-runs" if args.distinct_runs else "--no-distinct-runs",
              f"--num-decode-steps={args.num_decode_steps}", f"--offload-decode-policy={args.offload_decode_policy}",
              f"--offload-kv-cache-dtype={args.offload_kv_cache_dtype}",
              f"--offload-sparse-cache-gb={args.offload_sparse_cache_gb}"]
    for phase in phases:
        for shape in shapes if phase not in ("batch1", "offload") else shapes[-1:]:
            t = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--run-phase", phase, "--shape", shape, "--out", args.out,
                            *extra], check=True)
            print(f"phase {phase} {shape}: {time.perf_counter() - t:.0f} s", flush=True)
    report([Path(args.out)], Path(args.out))


if __name__ == "__main__":
    main()
