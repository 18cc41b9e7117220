"""Offload engine benchmark on one GPU: Llama-3.1-8B shape, random bf16 weights.

Each phase runs in a fresh process (so its peak GPU memory is its own) and writes phase_<name>.json:
  chunked    ours, KV offloaded, chunked prefill: prefill and per-token decode at each context
  layerwise  ours, KV offloaded, layerwise prefill (peak memory reported on its own)
  in_gpu     ours, KV in GPU memory
  overlap    per phase (decode, chunked prefill, layerwise prefill): with transfers, transfers alone (the same
             blocks through the ring, trivial consumer) and compute alone (the same engine, blocks kept on GPU)
  logits     last 64 logits of a 32K prompt: ours offloaded vs ours in-GPU vs transformers on the same weights,
             with ours in float32 as the reference
  hf         transformers' dynamic and offloaded caches, prefill and per-token decode (a streamer's clock)
Every timed figure is the median of >= 5 runs after a warm-up at the same shape, with min and max.
`--no-batch-invariant` runs our engines without the batch-invariant mode (the default since 2026-12-01; phase files
from before ran without it). `--report` turns the phase files into offload.json, offload.md and offload.png.

    python bench/bench_offload.py --phases hf,logits --out DIR       # one device call
    python bench/bench_offload.py --phases chunked --out DIR         # another
    python bench/bench_offload.py --phases layerwise,in_gpu,overlap --out DIR
    python bench/bench_offload.py --report DIR --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    SHAPES, GiB, RandomModel, add_batch_invariant_option, batch_invariant_label, fmt, gpu_memory, h2d_bandwidth,
    run_metadata, run_phases, stats,
)

from jax_offload.config import OFFLOAD_DEFAULTS  # noqa: E402

PHASES = ("chunked", "layerwise", "in_gpu", "overlap", "logits", "hf")


# ---- phases ---------------------------------------------------------------------------------------


def phase_chunked(b: RandomModel, a) -> dict:
    import resource

    rows, bs = [], a.block_size
    llm = b.llm(max_model_len=b.cfg.max_position_embeddings, offload=True, block_size=bs,
                num_ring_slots=a.ring_slots, prefill="chunked")
    b.warm_offload(llm)
    for ctx in a.contexts:
        n = b.prompt_len(ctx)
        row = {"ctx": ctx, "prompt_tokens": n, "host_blocks": n // bs, **b.timed(llm, n)}
        # Only full blocks cross PCIe; the partial block stays on the GPU as the tail.
        row["pcie_bytes_per_token_step"] = (n // bs) * bs * b.cfg.kv_bytes_per_token
        row["gpu_memory_after"] = gpu_memory()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "max_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "store_GiB": llm._runner.store.total_bytes / GiB}


def phase_layerwise(b: RandomModel, a) -> dict:
    bs = a.block_size
    n = a.layerwise_ctx
    before = gpu_memory()
    llm = b.llm(max_model_len=n + a.decode_tokens + bs, offload=True, block_size=bs, num_ring_slots=a.ring_slots,
                prefill="layerwise")
    row = {"ctx": n, "host_blocks": n // bs, **b.timed(llm, n), "gpu_memory_before": before,
           "gpu_memory_after": gpu_memory()}
    print(json.dumps(row), flush=True)
    return {"rows": [row]}


def phase_in_gpu(b: RandomModel, a) -> dict:
    rows = []
    for n in a.in_gpu_contexts:
        llm = b.llm(max_model_len=n + a.decode_tokens + 16)
        row = {"ctx": n, **b.timed(llm, n), "gpu_memory_after": gpu_memory()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
    return {"rows": rows}


def _stream_seconds(store, num_slots: int, schedule: list) -> float:
    """Seconds to stream `schedule` (layer, block) keys through the ring with a trivial consumer."""
    import jax

    from jax_offload.kv.ring import BlockRing, group_size, grouped

    groups = grouped(schedule, group_size(num_slots))
    t = time.perf_counter()
    ring = BlockRing(store, num_slots, groups)
    last = None
    for g in groups:
        last = ring.take()
        ring.release(last[-1], len(g))  # the consumer is the transfer itself
    jax.block_until_ready(last)
    return time.perf_counter() - t


def _write_seconds(store, num_layers: int, num_blocks: int) -> float:
    """Seconds to write `num_blocks` GPU blocks of every layer into the host store, as prefill does."""
    import jax
    import jax.numpy as jnp

    kv = jnp.ones((2, store.block_size) + store.block_shape[:1] + store.block_shape[-1:], jnp.bfloat16)
    jax.block_until_ready(kv)
    store.reset()
    t = time.perf_counter()
    for layer in range(num_layers):
        for i in range(num_blocks):
            store.write(layer, i, kv)
    jax.block_until_ready(store._blocks)
    return time.perf_counter() - t


def _compute_only(llm):
    """The same engine with its KV store on the GPU: the ring's copies become no-ops, dispatches unchanged."""
    from jax_offload.kv.host_store import HostKVStore

    s = llm._runner.store
    llm._runner.store = HostKVStore(s.num_layers, s.num_blocks, s.block_size, s.block_shape[0], s.block_shape[-1],
                                    llm.dtype, s.tp, host_memory_kind="device")
    return llm


def _overlap(with_s, transfer_s, compute_s) -> dict:
    w, t, c = (x["median"] for x in (with_s, transfer_s, compute_s))
    return {"with_transfers": with_s, "transfers_alone": transfer_s, "compute_alone": compute_s,
            "hidden_fraction": (t + c - w) / min(t, c)}


def phase_overlap(b: RandomModel, a) -> dict:
    import jax

    bs, out = a.block_size, {}
    layers = b.cfg.num_layers
    reps = a.repeats

    # Decode at the overlap context: per-token step time.
    n = a.overlap_ctx
    mk = dict(max_model_len=n + a.decode_tokens + bs, offload=True, block_size=bs, num_ring_slots=a.ring_slots)
    llm = b.llm(**mk)
    with_t = b.timed(llm, n)["decode_ms"]
    store = llm._runner.store
    store.mark_written(n // bs)  # the finished request's blocks are still there: stream them again
    keys = [(l, i) for l in range(layers) for i in range(n // bs)]
    _stream_seconds(store, a.ring_slots, keys)
    transfer = stats([_stream_seconds(store, a.ring_slots, keys) * 1e3 for _ in range(reps)])
    store.reset()
    compute = b.timed(_compute_only(b.llm(**mk)), n)["decode_ms"]
    out["decode"] = {"ctx": n, **_overlap(with_t, transfer, compute)}
    print(json.dumps(out["decode"]), flush=True)

    # Chunked prefill reads sum(c) earlier blocks per layer and writes every block once.
    n = a.prefill_overlap_ctx
    chunks = n // bs
    mk = dict(max_model_len=n + a.decode_tokens + bs, offload=True, block_size=bs, num_ring_slots=a.ring_slots)
    for mode in ("chunked", "layerwise"):
        llm = b.llm(**mk, prefill=mode)
        with_t = stats([x * 1e3 for x in [b.generate(llm, n, 1).prefill_seconds for _ in range(reps + 1)][1:]])
        store = llm._runner.store
        reads = [(l, i) for c in range(chunks) for l in range(layers) for i in range(c)] if mode == "chunked" else []
        transfer = []
        for _ in range(reps + 1):
            store.mark_written(chunks)
            t = _stream_seconds(store, a.ring_slots, reads) if reads else 0.0
            transfer.append((t + _write_seconds(store, layers, chunks)) * 1e3)
        store.reset()
        compute_llm = _compute_only(b.llm(**mk, prefill=mode))
        compute = stats([x * 1e3 for x in [b.generate(compute_llm, n, 1).prefill_seconds for _ in range(reps + 1)][1:]])
        out[f"prefill_{mode}"] = {"ctx": n, **_overlap(with_t, stats(transfer[1:]), compute)}
        print(json.dumps(out[f"prefill_{mode}"]), flush=True)
        del llm, compute_llm
        jax.clear_caches()
    return out


def phase_logits(b: RandomModel, a) -> dict:
    """Last 64 logits of one prompt: how far the offloaded engine is from the in-GPU one, beside how far the
    in-GPU one is from transformers on the same weights."""
    import numpy as np

    last = 64
    ids = b.prompt(a.logits_ctx)
    bs = a.block_size
    got = {"ours_in_gpu_bf16": b.llm(max_model_len=len(ids) + 16).logits(ids, last=last)}
    got["ours_offload_bf16"] = b.llm(max_model_len=len(ids) + bs, offload=True, block_size=bs,
                                     num_ring_slots=a.ring_slots).logits(ids, last=last)
    got["transformers_bf16"] = _hf_logits(b, a.shape, ids, last)

    def diff(x, y):
        return float(np.abs(got[x] - got[y]).max())

    top1 = {k: v.argmax(-1) for k, v in got.items()}
    res = {"ctx": len(ids), "positions": last, "max_abs_logit": float(np.abs(got["ours_in_gpu_bf16"]).max()),
           "offload_vs_in_gpu": diff("ours_offload_bf16", "ours_in_gpu_bf16"),
           "in_gpu_vs_transformers": diff("ours_in_gpu_bf16", "transformers_bf16"),
           "offload_vs_transformers": diff("ours_offload_bf16", "transformers_bf16"),
           "top1_agreement_offload_vs_in_gpu": float(np.mean(top1["ours_offload_bf16"] == top1["ours_in_gpu_bf16"])),
           "top1_agreement_in_gpu_vs_transformers": float(np.mean(top1["ours_in_gpu_bf16"] == top1["transformers_bf16"]))}
    print(json.dumps(res), flush=True)
    return res


def _hf_logits(b: RandomModel, shape: str, ids: list[int], last: int):
    """transformers' LlamaForCausalLM (sdpa, bf16) over our very weights, shared through DLPack."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = b.cfg
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = {k: v for k, v in SHAPES[shape].items() if k not in ("architectures", "model_type")}
    raw["num_hidden_layers"] = cfg.num_layers
    hf_cfg = LlamaConfig(**raw)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)

    def t(x):
        return torch.from_dlpack(x)

    def assign(module, name, tensor):
        setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    p = b.params
    assign(model.model.embed_tokens, "weight", t(p.embed))
    assign(model.model.norm, "weight", t(p.final_norm))
    assign(model.lm_head, "weight", t(p.lm_head).T)
    for layer, lp in zip(model.model.layers, p.layers):
        wqkv = t(lp.wqkv)
        assign(layer.self_attn.q_proj, "weight", wqkv[:, :q].T)
        assign(layer.self_attn.k_proj, "weight", wqkv[:, q:q + kv].T)
        assign(layer.self_attn.v_proj, "weight", wqkv[:, q + kv:].T)
        assign(layer.self_attn.o_proj, "weight", t(lp.wo).T)
        gate_up = t(lp.w_gate_up)
        assign(layer.mlp.gate_proj, "weight", gate_up[:, :cfg.intermediate_size].T)
        assign(layer.mlp.up_proj, "weight", gate_up[:, cfg.intermediate_size:].T)
        assign(layer.mlp.down_proj, "weight", t(lp.w_down).T)
        assign(layer.input_layernorm, "weight", t(lp.attn_norm))
        assign(layer.post_attention_layernorm, "weight", t(lp.mlp_norm))
    with torch.device(device):  # the only buffers: rotary frequencies, made where the weights are
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], device=device), use_cache=False, logits_to_keep=last).logits
    logits = out[0].float().cpu().numpy()
    del model, out
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits


HF_SCRIPT = r"""
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

class Clock(BaseStreamer):
    # generate() hands the prompt, then each new token, to put() after moving it to the CPU (a sync).
    def __init__(self): self.times = []
    def put(self, value): self.times.append(time.perf_counter())
    def end(self): pass

cfg = LlamaConfig(**json.loads(sys.argv[1])); cfg._attn_implementation = "sdpa"
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
model.eval()
tokens, repeats = int(sys.argv[3]), int(sys.argv[4])

def run(ids, cache):
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=Clock())
    if cache != "dynamic": kw["cache_implementation"] = cache
    torch.cuda.synchronize(); start = time.perf_counter()
    with torch.no_grad(): model.generate(ids, **kw)
    t = kw["streamer"].times
    return t[1] - start, [(y - x) * 1e3 for x, y in zip(t[1:], t[2:])]

out = []
for ctx, caches in json.loads(sys.argv[2]):
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
    for cache in caches:
        try:
            run(ids, cache)  # warm-up at this very shape
            torch.cuda.reset_peak_memory_stats()
            prefill, steps = [], []
            for _ in range(repeats):
                p, s = run(ids, cache); prefill.append(p); steps += s
            row = dict(ctx=ctx, cache=cache, prefill_s=prefill, decode_ms=steps,
                       peak_gpu_GiB=torch.cuda.max_memory_allocated() / 2**30)
        except Exception as e:
            row = dict(ctx=ctx, cache=cache, error=repr(e)[:300])
        print(json.dumps({k: v for k, v in row.items() if k not in ("prefill_s", "decode_ms")}), flush=True)
        out.append(row); torch.cuda.empty_cache()
print("RESULT " + json.dumps(out))
"""


def phase_hf(a) -> dict:
    raw = {k: v for k, v in SHAPES[a.shape].items() if k not in ("architectures", "model_type")}
    if a.num_layers:
        raw["num_hidden_layers"] = a.num_layers
    plan = [(ctx, ["dynamic", "offloaded"] if ctx in a.hf_offloaded_contexts else ["dynamic"]) for ctx in a.hf_contexts]
    proc = subprocess.run([sys.executable, "-c", HF_SCRIPT, json.dumps(raw), json.dumps(plan), str(a.decode_tokens),
                           str(a.repeats)], capture_output=True, text=True, timeout=a.hf_timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"error": (proc.stderr or proc.stdout)[-3000:]}
    rows = []
    for r in json.loads(lines[-1][len("RESULT "):]):
        if "error" not in r:
            r["prefill_s"], r["decode_ms"] = stats(r["prefill_s"]), stats(r["decode_ms"])
        rows.append(r)
    return {"rows": rows}


# ---- report ---------------------------------------------------------------------------------------


def report(src: Path, out: Path) -> None:
    phases = {p: json.loads((src / f"phase_{p}.json").read_text()) for p in PHASES if (src / f"phase_{p}.json").exists()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload.json").write_text(json.dumps(phases, indent=1))
    any_phase = next(iter(phases.values()))
    meta = any_phase["meta"]
    bw = any_phase["h2d_Bps"]
    kv_tok = any_phase["kv_bytes_per_token"]
    lines = [
        f"# Offload benchmark: {meta['shape']} shape, random bf16 weights", "",
        f"{meta['device']} | jax {meta['jax']} | torch {meta.get('torch', '?')} | transformers {meta.get('transformers', '?')} "
        f"| {meta['date']} | {batch_invariant_label(meta)}", "",
        f"Weights {any_phase['weights_GiB']:.2f} GiB. Host->GPU bandwidth of one 1 GiB pinned copy: {fmt(bw, 1e-9, 1)} GB/s "
        f"(median (min-max) of {bw['n']}). KV {kv_tok // 1024} KiB/token. Every time below is the median (min-max) of "
        f">= {meta['repeats']} runs after a warm-up at the same shape; decode figures pool every step of those runs.",
        "PCIe floor of a decode step = bytes of the full blocks in the host store (the partial block stays on the GPU) / "
        "the median bandwidth.", "",
        "| engine | ctx | prefill s | decode ms/token | floor ms | decode / floor | GPU GiB in use after | peak GiB of the phase so far |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in (("chunked", "ours, offloaded, chunked prefill"), ("layerwise", "ours, offloaded, layerwise prefill"),
                        ("in_gpu", "ours, KV in GPU memory")):
        for r in phases.get(name, {}).get("rows", []):
            floor = r.get("host_blocks", 0) * meta["block_size"] * kv_tok / bw["median"] * 1e3 if "host_blocks" in r else None
            ratio = f"{r['decode_ms']['median'] / floor:.3f}" if floor else "-"
            mem = r["gpu_memory_after"]
            lines.append(f"| {label} | {r['ctx']} | {fmt(r['prefill_s'], 1, 3)} | {fmt(r['decode_ms'])} | "
                         f"{f'{floor:.1f}' if floor else '-'} | {ratio} | {mem['in_use_GiB']:.2f} | {mem['peak_GiB']:.2f} |")
    for r in phases.get("hf", {}).get("rows", []):
        if "error" in r:
            lines.append(f"| transformers, {r['cache']} cache | {r['ctx']} | error: {r['error'][:80]} | | | | | |")
        else:
            lines.append(f"| transformers, {r['cache']} cache | {r['ctx']} | {fmt(r['prefill_s'], 1, 3)} | {fmt(r['decode_ms'])} "
                         f"| - | - | - | {r['peak_gpu_GiB']:.2f} (torch, reset per context) |")
    lines += ["", "Peak GPU memory: each engine runs in its own process; contexts run in increasing order, so the peak "
              "column of a row is that process's peak over this context and the shorter ones before it."]
    ch = phases.get("chunked", {})
    if "progress_bar" in ch:
        p = ch["progress_bar"]
        lines += ["", f"Progress bar (the CLI's `generate(progress=True)`), chunked prefill of {p['ctx']} tokens: "
                  f"{fmt(p['with_bar_s'], 1, 3)} s with it, {fmt(p['without_s'], 1, 3)} s without: cost {p['cost'] * 100:+.1f}% "
                  "(ratio of medians)."]
    ov = phases.get("overlap")
    if ov:
        lines += ["", "Transfer/compute overlap. Hidden fraction = (transfers alone + compute alone - with transfers) / "
                  "min(transfers alone, compute alone): 1 means the smaller side is fully hidden, 0 means serial.", "",
                  "| phase | ctx | with transfers ms | transfers alone ms | compute alone ms | hidden fraction |", "|---|---|---|---|---|---|"]
        for k in ("decode", "prefill_chunked", "prefill_layerwise"):
            if k in ov:
                r = ov[k]
                lines.append(f"| {k} | {r['ctx']} | {fmt(r['with_transfers'], 1, 1)} | {fmt(r['transfers_alone'], 1, 1)} | "
                             f"{fmt(r['compute_alone'], 1, 1)} | {r['hidden_fraction']:.2f} |")
    lg = phases.get("logits")
    if lg:
        lines += ["", f"bfloat16 exactness, last {lg['positions']} logits of a {lg['ctx']}-token prompt (max |logit| "
                  f"{lg['max_abs_logit']:.2f}), max |difference|: ours offloaded (chunked) vs ours in-GPU "
                  f"{lg['offload_vs_in_gpu']:.4f}; ours in-GPU vs transformers (sdpa) on the same weights "
                  f"{lg['in_gpu_vs_transformers']:.4f}; ours offloaded vs transformers {lg['offload_vs_transformers']:.4f}. "
                  f"Same top-1 token: offloaded vs in-GPU {lg['top1_agreement_offload_vs_in_gpu']:.3f}, in-GPU vs "
                  f"transformers {lg['top1_agreement_in_gpu_vs_transformers']:.3f}."]
    (out / "offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import plots

    plots.decode_vs_context(phases, out / "offload.png")


# ---- driver ---------------------------------------------------------------------------------------


def run_phase(args) -> None:
    name = args.run_phase
    if name == "hf":
        result = phase_hf(args)
        result["meta"] = run_metadata()
    else:
        b = RandomModel(args.shape, args.num_layers, tokens=args.decode_tokens, repeats=args.repeats,
                        batch_invariant=args.batch_invariant)
        result = globals()[f"phase_{name}"](b, args)
        result |= {"weights_GiB": b.weights_GiB, "kv_bytes_per_token": b.cfg.kv_bytes_per_token,
                   "h2d_Bps": h2d_bandwidth(), "gpu_memory_at_end": gpu_memory(), "meta": run_metadata()}
    result["meta"] |= {"shape": args.shape, "block_size": args.block_size, "ring_slots": args.ring_slots,
                       "repeats": args.repeats, "num_layers": args.num_layers}
    if name != "hf":
        result["meta"]["batch_invariant"] = args.batch_invariant
    result.setdefault("h2d_Bps", None)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"phase_{name}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    p.add_argument("--phases", default="", help=f"comma-separated, each in its own process: {','.join(PHASES)}")
    p.add_argument("--run-phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help="assemble offload.md/json/png from the phase files in this folder")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--num-layers", type=int, help="fewer layers, for a smoke run")
    p.add_argument("--contexts", type=ints, default=[8192, 32768, 65536, 131072])
    p.add_argument("--block-size", type=int, default=OFFLOAD_DEFAULTS["block_size"])
    p.add_argument("--ring-slots", type=int, default=OFFLOAD_DEFAULTS["num_ring_slots"])
    p.add_argument("--layerwise-ctx", type=int, default=32768)
    p.add_argument("--in-gpu-contexts", type=ints, default=[8192])
    p.add_argument("--overlap-ctx", type=int, default=65536)
    p.add_argument("--prefill-overlap-ctx", type=int, default=32768)
    p.add_argument("--logits-ctx", type=int, default=32768)
    p.add_argument("--hf-contexts", type=ints, default=[8192, 32768, 65536])
    p.add_argument("--hf-offloaded-contexts", type=ints, default=[8192, 32768])
    p.add_argument("--decode-tokens", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hf-timeout", type=int, default=420)
    add_batch_invariant_option(p)
    args = p.parse_args()
    if args.report:
        report(args.report, args.out)
        return
    if args.run_phase:
        run_phase(args)
        return
    run_phases(__file__, [(name, [name]) for name in args.phases.split(",") if name], args.phases)


if __name__ == "__main__":
    main()
