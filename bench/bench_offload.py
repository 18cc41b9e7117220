"""Offload engine benchmark on one GPU: Llama-3.1-8B shape, random bf16 weights.

Measures, in one run: the PCIe floor (KV bytes / measured host-to-device bandwidth), our offloaded and
in-GPU prefill and decode, GPU memory, the transfer/compute overlap of each mode, and Hugging Face
transformers' dynamic and offloaded caches on the same GPU (in a subprocess, so the two frameworks do
not share GPU memory). Writes offload.json, offload.md and offload.png under --out.

    python bench/bench_offload.py --out bench/results
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
GiB = 2**30


def random_params(cfg, dtype, seed: int = 0):
    """Random weights at the config's shapes, made on the GPU (the real 8B checkpoint is not needed)."""
    import jax
    import jax.numpy as jnp

    from jax_offload.models.params import LayerParams, ModelParams

    key = jax.random.PRNGKey(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

    @functools.partial(jax.jit, static_argnums=1)
    def rnd(k, shape):
        # Drawn in the target dtype: no float32 temporaries inflating the GPU memory peak.
        return jax.random.normal(k, shape, dtype) * jnp.asarray(0.02, dtype)

    layers = []
    for n in range(cfg.num_layers):
        ks = jax.random.split(jax.random.fold_in(key, n), 4)
        layers.append(
            LayerParams(
                attn_norm=jnp.ones((h,), dtype),
                wqkv=rnd(ks[0], (h, qkv)),
                bqkv=None,
                q_norm=None,
                k_norm=None,
                wo=rnd(ks[1], (cfg.num_heads * d, h)),
                mlp_norm=jnp.ones((h,), dtype),
                w_gate_up=rnd(ks[2], (h, 2 * i)),
                w_down=rnd(ks[3], (i, h)),
            )
        )
    ks = jax.random.split(jax.random.fold_in(key, 10_000), 2)
    return ModelParams(
        embed=rnd(ks[0], (cfg.vocab_size, h)),
        layers=layers,
        final_norm=jnp.ones((h,), dtype),
        lm_head=rnd(ks[1], (h, cfg.vocab_size)),
    )


def h2d_bandwidth(nbytes: int = GiB, reps: int = 5) -> float:
    """Bytes/s of one pinned-host -> GPU copy (best of `reps`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    host = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), SingleDeviceSharding(dev, memory_kind="pinned_host"))
    host.block_until_ready()
    target = SingleDeviceSharding(dev, memory_kind="device")
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.device_put(host, target).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def gpu_peak_bytes() -> int:
    import jax

    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    return int(stats.get("peak_bytes_in_use", 0))


def tree_bytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def run_ours(args) -> dict:
    import jax
    import numpy as np

    from jax_offload import LLM, SamplingParams
    from jax_offload.config import ModelConfig
    from jax_offload.kv.ring import group_size

    cfg = ModelConfig.from_dict(LLAMA_31_8B | {"num_hidden_layers": args.num_layers})
    params = random_params(cfg, jax.numpy.bfloat16)
    jax.block_until_ready(params)
    weights = tree_bytes(params)
    bw = h2d_bandwidth()
    rng = np.random.default_rng(0)
    res: dict = {"weights_GiB": weights / GiB, "peak_gpu_after_init_GiB": gpu_peak_bytes() / GiB, "h2d_GBps": bw / 1e9, "kv_bytes_per_token": cfg.kv_bytes_per_token}
    new = args.decode_tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def make(**opts):
        return LLM.from_params(cfg, params, dtype="bfloat16", **opts)

    max_pos = cfg.max_position_embeddings

    def prompt_len(ctx):
        # "128K" fills the model's whole window: the prompt leaves room for the generated tokens.
        return min(ctx, max_pos - new - 1)

    def timed(llm, n_ctx):
        out = llm.generate([rng.integers(0, 128000, size=n_ctx).tolist()], greedy)[0]
        return out.prefill_seconds, out.decode_seconds / (len(out.token_ids) - 1) * 1e3

    def floor_ms(n_ctx):
        return n_ctx * cfg.kv_bytes_per_token / bw * 1e3

    rows = []
    for ctx in args.contexts:
        for bs in args.block_sizes:
            llm = make(max_model_len=min(ctx + new + bs, max_pos), offload=True, block_size=bs,
                       num_ring_slots=args.ring_slots, prefill="chunked")
            # Compiles every chunked-prefill and decode shape; none depends on the prompt length, only on
            # the size of the last group of blocks (1 .. half the ring) and on whether the tail starts empty.
            for n in range(1, group_size(args.ring_slots) + 2):
                timed(llm, n * bs)
            timed(llm, bs + 7)
            runs = [timed(llm, prompt_len(ctx)) for _ in range(args.repeats)]
            prefill_s, decode_ms = min(r[0] for r in runs), min(r[1] for r in runs)
            rows.append(dict(mode="offload", prefill="chunked", ctx=ctx, block_size=bs, ring_slots=args.ring_slots,
                             prompt_tokens=prompt_len(ctx), prefill_s=prefill_s, decode_ms=decode_ms, runs=runs,
                             floor_ms=floor_ms(prompt_len(ctx)), peak_gpu_GiB=gpu_peak_bytes() / GiB))
            print(json.dumps(rows[-1]), flush=True)
            del llm
            gc.collect()
    bs = args.block_sizes[0]
    for ctx in args.layerwise_contexts:
        llm = make(max_model_len=ctx + new + bs, offload=True, block_size=bs, num_ring_slots=args.ring_slots,
                   prefill="layerwise")
        timed(llm, ctx)  # layerwise shapes follow the prompt bucket: compile at this length
        prefill_s, decode_ms = timed(llm, ctx)
        rows.append(dict(mode="offload", prefill="layerwise", ctx=ctx, block_size=bs, ring_slots=args.ring_slots,
                         prompt_tokens=ctx, prefill_s=prefill_s, decode_ms=decode_ms, floor_ms=floor_ms(ctx)))
        print(json.dumps(rows[-1]), flush=True)
        del llm
        gc.collect()
    for ctx in args.in_gpu_contexts:
        llm = make(max_model_len=ctx + new + 16)
        timed(llm, ctx)
        prefill_s, decode_ms = timed(llm, ctx)
        rows.append(dict(mode="in_gpu", prefill="whole", ctx=ctx, prompt_tokens=ctx, prefill_s=prefill_s,
                         decode_ms=decode_ms))
        print(json.dumps(rows[-1]), flush=True)
        del llm
        gc.collect()
    res["rows"] = rows
    # Last, because keeping every block on the GPU (compute alone) raises the memory peak.
    res["overlap"] = measure_overlap(make, args, new, rng)
    return res


def _stream_time(store, num_slots: int, schedule: list) -> float:
    """Seconds to stream `schedule` through the ring with a trivial consumer: transfers alone."""
    import jax

    from jax_offload.kv.ring import BlockRing, group_size, grouped

    groups = grouped(schedule, group_size(num_slots))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        ring = BlockRing(store, num_slots, groups)
        last = None
        for g in groups:
            last = ring.take()
            ring.release(last[-1], len(g))  # the consumer is the transfer itself
        jax.block_until_ready(last)
        best = min(best, time.perf_counter() - t)
    return best


def _offload_time(store, num_layers: int, num_blocks: int) -> float:
    """Seconds to copy `num_blocks` blocks of every layer from the GPU to the host store."""
    import jax

    blocks = [jax.device_put(store.read(l, b), store.device) for l in range(num_layers) for b in range(num_blocks)]
    jax.block_until_ready(blocks)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready([jax.device_put(b, store.host) for b in blocks])
        best = min(best, time.perf_counter() - t)
    return best


class _BlocksOnDevice:
    """Within this context the store keeps every block on the GPU: the ring's copies become no-ops, so
    the engine runs its exact dispatches with compute alone."""

    def __init__(self, store):
        self.store = store

    def __enter__(self):
        import jax

        store = self.store
        self.saved = store._blocks, store.write
        store._blocks = [list(layer) for layer in store._blocks]

        def write_on_device(layer, index, block):
            store._blocks[layer][index] = jax.device_put(block, store.device)
            store._written[layer] += 1

        store.write = write_on_device
        return self

    def __exit__(self, *exc):
        self.store._blocks, self.store.write = self.saved


def measure_overlap(make, args, new, rng) -> list[dict]:
    """For each phase: time with transfers, transfers alone, compute alone (the same dispatches)."""
    from jax_offload import SamplingParams

    bs, out = args.block_sizes[0], []
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def decode_ms(o):
        return o.decode_seconds / (len(o.token_ids) - 1) * 1e3

    ctx = args.overlap_ctx
    llm = make(max_model_len=ctx + new + bs, offload=True, block_size=bs, num_ring_slots=args.ring_slots)
    ids = rng.integers(0, 128000, size=ctx).tolist()
    with_transfer = decode_ms(llm.generate([ids], greedy)[0])
    store, layers = llm._runner.store, llm.model_config.num_layers
    store._written = [ctx // bs] * layers  # the finished request's blocks are still there: read them again
    transfer = _stream_time(store, args.ring_slots, [(l, b) for l in range(layers) for b in range(ctx // bs)]) * 1e3
    store.reset()
    with _BlocksOnDevice(store):
        compute = decode_ms(llm.generate([ids], greedy)[0])
    out.append(dict(mode="decode", ctx=ctx, with_transfer_ms=with_transfer, transfer_only_ms=transfer,
                    compute_only_ms=compute))

    # Chunked prefill reads sum(c) earlier blocks per layer and writes every block once.
    ctx = args.prefill_overlap_ctx
    n = ctx // bs
    ids = rng.integers(0, 128000, size=ctx).tolist()
    with_transfer = llm.generate([ids], one)[0].prefill_seconds * 1e3
    store._written = [n] * layers
    reads = [(l, b) for c in range(n) for l in range(layers) for b in range(c)]
    transfer = (_stream_time(store, args.ring_slots, reads) + _offload_time(store, layers, n)) * 1e3
    store.reset()
    with _BlocksOnDevice(store):
        compute = llm.generate([ids], one)[0].prefill_seconds * 1e3
    out.append(dict(mode="prefill_chunked", ctx=ctx, with_transfer_ms=with_transfer, transfer_only_ms=transfer,
                    compute_only_ms=compute))
    del llm
    gc.collect()

    # Layerwise prefill: the layer compute of in-GPU prefill plus one offload of each layer's KV.
    llm = make(max_model_len=ctx + new + bs, offload=True, block_size=bs, num_ring_slots=args.ring_slots,
               prefill="layerwise")
    llm.generate([ids], one)
    with_transfer = llm.generate([ids], one)[0].prefill_seconds * 1e3
    store = llm._runner.store
    store._written = [n] * layers
    transfer = _offload_time(store, layers, n) * 1e3
    store.reset()
    with _BlocksOnDevice(store):
        compute = llm.generate([ids], one)[0].prefill_seconds * 1e3
    out.append(dict(mode="prefill_layerwise", ctx=ctx, with_transfer_ms=with_transfer, transfer_only_ms=transfer,
                    compute_only_ms=compute))
    for r in out:
        r["ratio"] = r["with_transfer_ms"] / max(r["transfer_only_ms"], r["compute_only_ms"])
        print(json.dumps(r), flush=True)
    return out


HF_SCRIPT = r"""
import json, os, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(**json.loads(sys.argv[1])); cfg._attn_implementation = "sdpa"
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
model.eval()
with torch.no_grad():  # warm-up: first-call library initialisation must not count as prefill
    model.generate(torch.randint(0, 128000, (1, 512), device="cuda"), max_new_tokens=2, do_sample=False)
new = int(sys.argv[3]); out = []
for ctx in json.loads(sys.argv[2]):
    ids = torch.randint(0, 128000, (1, ctx), device="cuda")
    for impl in ("dynamic", "offloaded"):
        try:
            kw = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False)
            if impl != "dynamic": kw["cache_implementation"] = impl
            torch.cuda.synchronize(); t = time.perf_counter()
            with torch.no_grad(): model.generate(ids, **kw)
            torch.cuda.synchronize(); t1 = time.perf_counter() - t
            kw["max_new_tokens"] = kw["min_new_tokens"] = new
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
            with torch.no_grad(): model.generate(ids, **kw)
            torch.cuda.synchronize(); t2 = time.perf_counter() - t
            row = dict(ctx=ctx, cache=impl, prefill_s=t1, decode_ms=(t2 - t1) / (new - 1) * 1e3,
                       peak_gpu_GiB=torch.cuda.max_memory_allocated() / 2**30)
        except Exception as e:
            row = dict(ctx=ctx, cache=impl, error=repr(e)[:200])
        print(json.dumps(row), flush=True); out.append(row)
        torch.cuda.empty_cache()
import transformers
print("RESULT " + json.dumps(dict(rows=out, torch=torch.__version__, transformers=transformers.__version__)))
"""


def run_hf(args) -> dict:
    cfg = {k: v for k, v in LLAMA_31_8B.items() if k not in ("architectures", "model_type")}
    cfg["num_hidden_layers"] = args.num_layers
    proc = subprocess.run(
        [sys.executable, "-c", HF_SCRIPT, json.dumps(cfg), json.dumps(args.hf_contexts), str(args.decode_tokens)],
        capture_output=True, text=True, timeout=args.hf_timeout,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload.json").write_text(json.dumps(result, indent=1))
    ours, hf = result["ours"], result.get("hf", {})
    lines = [
        "# Offload benchmark: Llama-3.1-8B shape, random bf16 weights",
        "",
        f"{result['device']} | jax {result['jax']} | torch {hf.get('torch', '?')} | transformers "
        f"{hf.get('transformers', '?')} | {result['date']}",
        "",
        f"Weights {ours['weights_GiB']:.2f} GiB; host->device {ours['h2d_GBps']:.1f} GB/s (1 GiB pinned copy); "
        f"KV {ours['kv_bytes_per_token'] // 1024} KiB/token. PCIe floor = KV bytes / that bandwidth.",
        "",
        "| engine | prefill | ctx | block | prefill s | decode ms/token | floor ms | decode/floor | peak GPU GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in ours["rows"]:
        floor = r.get("floor_ms")
        ratio = r["decode_ms"] / floor if floor else None
        lines.append(
            f"| ours {r['mode']} | {r['prefill']} | {r['ctx']} | {r.get('block_size', '-')} | {r['prefill_s']:.3f} | "
            f"{r['decode_ms']:.2f} | {fmt(floor, '.1f')} | {fmt(ratio, '.3f')} | {fmt(r.get('peak_gpu_GiB'), '.2f')} |"
        )
    for r in hf.get("rows", []):
        if "error" in r:
            lines.append(f"| transformers {r['cache']} | - | {r['ctx']} | - | error: {r['error'][:60]} | | | | |")
        else:
            lines.append(
                f"| transformers {r['cache']} | - | {r['ctx']} | - | {r['prefill_s']:.3f} | {r['decode_ms']:.2f} | - | - | "
                f"{r['peak_gpu_GiB']:.2f} |"
            )
    ov = ours.get("overlap", [])
    if ov:
        lines += ["", "Transfer/compute overlap, same dispatches: transfers alone stream the same blocks with a trivial",
                  "consumer (plus the GPU->host writes for prefill); compute alone runs the same engine with every block",
                  "kept on the GPU. Overlapped means with-transfer <= 1.15 x max(transfer, compute).", "",
                  "| phase | ctx | with transfers ms | transfers alone ms | compute alone ms | ratio to max |",
                  "|---|---|---|---|---|---|"]
        for r in ov:
            lines.append(f"| {r['mode']} | {r['ctx']} | {r['with_transfer_ms']:.1f} | {r['transfer_only_ms']:.1f} | "
                         f"{r['compute_only_ms']:.1f} | {r['ratio']:.3f} |")
    (out / "offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for bs in sorted({r["block_size"] for r in ours["rows"] if r["mode"] == "offload" and r["prefill"] == "chunked"}):
            rs = [r for r in ours["rows"] if r["mode"] == "offload" and r["prefill"] == "chunked" and r["block_size"] == bs]
            ax.plot([r["ctx"] for r in rs], [r["decode_ms"] for r in rs], "o-", label=f"ours offloaded (block {bs})")
        rs = [r for r in ours["rows"] if r["mode"] == "offload" and r["prefill"] == "chunked"]
        ctxs = sorted({r["ctx"] for r in rs})
        ax.plot(ctxs, [c * ours["kv_bytes_per_token"] / (ours["h2d_GBps"] * 1e9) * 1e3 for c in ctxs], "k--", label="PCIe floor")
        for cache in ("dynamic", "offloaded"):
            rs = [r for r in hf.get("rows", []) if r["cache"] == cache and "error" not in r]
            if rs:
                ax.plot([r["ctx"] for r in rs], [r["decode_ms"] for r in rs], "s:", label=f"transformers {cache}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("decode ms / token")
        ax.set_title(f"Llama-3.1-8B shape, bf16, {result['device']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "offload.png", dpi=120)
    except ImportError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    p.add_argument("--contexts", type=ints, default=[8192, 32768, 65536, 131072])
    p.add_argument("--block-sizes", type=ints, default=[4096])
    p.add_argument("--ring-slots", type=int, default=4)
    p.add_argument("--layerwise-contexts", type=ints, default=[32768])
    p.add_argument("--in-gpu-contexts", type=ints, default=[8192])
    p.add_argument("--overlap-ctx", type=int, default=65536)
    p.add_argument("--prefill-overlap-ctx", type=int, default=32768)
    p.add_argument("--hf-contexts", type=ints, default=[8192, 32768, 65536])
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point; the best is reported")
    p.add_argument("--num-layers", type=int, default=32, help="fewer layers for a quick smoke run")
    p.add_argument("--hf-timeout", type=int, default=240)
    args = p.parse_args()
    hf = run_hf(args) if args.hf_contexts else {}  # before JAX takes the GPU
    import jax

    result = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    result["ours"] = run_ours(args)
    result["hf"] = hf
    write_report(result, args.out)


if __name__ == "__main__":
    main()
