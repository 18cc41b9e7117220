"""Sparse policies on one GPU: Llama-3.1-8B shape, random bf16 weights.

Phases (each in a fresh process, writing phase_<name>.json under --out):
  decode      the page-choosing decode policies (--policies, default sketch,quest) over the offloaded KV: ms/token
              and bytes moved per token at each context, the time of the choice at each context (the policy's
              scoring alone, as a call and as GPU time per token: the span of one call's kernels in a profiler
              trace (files before 2026-11-28 add the older (t4 - t1) / 3 estimate); the layers' q with scoring
              and top-k), full offloaded
              decode at the breakdown context in the same process, and there reading the chosen pages from pinned
              memory with attention over them against the same read from GPU memory
  xattn_kernel   XAttention's block-sparse kernel against our dense causal kernel at fixed densities of the
                 causal blocks (random choice per head and query block, sink and diagonal kept), and the
                 estimate of one layer (threshold 0.9) at the same length
  xattn_prefill  end-to-end prefill, full and XAttention at fixed densities (random weights attend nearly
                 uniformly, so a threshold would keep almost everything: the benchmark keeps the top blocks by
                 estimate instead), for each --xattn-modes (in_gpu, layerwise, chunked)
Every time is the median (min-max) of >= 5 measurements after a warm-up at the same shape. `--no-batch-invariant`
runs without the engine's batch-invariant mode (the default since 2026-12-01; earlier phase files ran without it).
`--report DIR [DIR ...]` writes sparse.md, sparse.json and sparse.png from the phase files, each phase from the first
folder that has it (runs of one phase on another device or day stay in their own folder). The Quest section of
bench/results/sparse.md comes from the older phase_quest.json (`runs/h200_quest_zero_copy/`), rendered by this file
at commit 8b2e288.

    python bench/bench_sparse.py --phases decode --contexts 32768,131072,262144 --out DIR
    python bench/bench_sparse.py --report DIR [DIR ...] --out bench/results
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB, RandomModel, add_batch_invariant_option, batch_invariant_label, call_seconds, fmt, gpu_memory, gpu_span_ms,
    model_config, run_metadata, run_phases, stats,
)

from jax_offload.config import OFFLOAD_DEFAULTS, PAGE_POLICY_DEFAULTS, SKETCH_DEFAULTS, XATTN_DEFAULTS  # noqa: E402

PHASES = ("decode", "xattn_kernel", "xattn_prefill")


def phase_decode(a) -> dict:
    """The decode phase of the module's docstring; the pages' read at the breakdown context for the first policy."""
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_offload.attention import embed_tokens, page_choice_step, page_read_step
    from jax_offload.kv.host_store import HostKVStore
    from jax_offload.kv.ring import group_size

    # Contexts past the checkpoint's window (256K on Llama-3.1) are positions like any other for timing.
    m = RandomModel(a.shape, a.num_layers, tokens=a.decode_tokens, min_positions=max(a.contexts) + 2 * a.block_size,
                    batch_invariant=a.batch_invariant)
    cfg, params = m.cfg, m.params
    bs, tokens = a.block_size, a.decode_tokens
    warm_up_blocks = 2 * group_size(a.ring_slots) + 1  # the longest warm-up prompt, in blocks
    max_len = max(max(a.contexts), warm_up_blocks * bs) + tokens + bs
    pages_per_block = bs // a.page_size

    # One request at a time, as README's long-prompt recipe: with the default 256, the first sketch or Quest
    # generate (the batch engine) keeps GPU tail slots for up to 256 requests (512 MiB each on the 8B shape at block
    # 4096) in most of the free memory, and the in-GPU copy of the store below no longer fits.
    def make(**kw):
        return m.llm(offload=True, block_size=bs, num_ring_slots=a.ring_slots, max_num_seqs=1, **kw)

    def options(policy):
        extra = {"sketch_dtype": a.sketch_dtype} if policy == "sketch" else {}
        if a.sparse_cache_gb:
            extra["sparse_cache_gb"] = a.sparse_cache_gb
        return dict(decode_policy=policy, decode_budget=a.budget, page_size=a.page_size, dense_layers=a.dense_layers,
                    **extra)

    def run(llm, n):
        out = m.generate(llm, n)
        return out.prefill_seconds, stats([s * 1e3 for s in out.decode_token_seconds])

    def warm_up(llm):  # the dense layers stream groups of 1 .. half the ring's blocks, twice over
        m.warm_offload(llm, groups=2)

    def timed(fn):
        return stats([t * 1e3 for t in call_seconds(fn, a.repeats)])

    x = embed_tokens(params.embed, np.full((1, 1), 7, np.int32))
    tail = jnp.zeros((2, bs, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    rows, memory, read = [], {}, None
    for policy in a.policies:
        llm = make(max_model_len=max_len, **options(policy))
        inv_freq, impl, runner = llm._inv_freq, llm.attention_impl, llm._runner
        warm_up(llm)
        pages = runner.pages
        layers = sorted(pages.layers)
        memory[policy] = {"metadata_GiB": pages.nbytes / GiB, "dense_layers_gpu_GiB": runner.store.gpu_bytes / GiB,
                          "host_store_GiB": runner.store.host_bytes / GiB}
        for ctx in a.contexts:
            n = min(ctx, cfg.max_position_embeddings - tokens - 1)
            prefill_s, decode = run(llm, n)
            row = {"policy": policy, "ctx": n, "prefill_s": prefill_s, "decode_ms": decode,
                   "pcie_bytes_per_token": runner.last_decode_pcie_bytes,
                   # With --sparse-cache-gb: of the pages the last step chose, the share already in GPU memory.
                   "page_cache_hit_rate": runner.page_cache.hit_rate() if runner.page_cache else None,
                   "expected_bytes": a.budget * (cfg.num_layers - a.dense_layers) * cfg.kv_bytes_per_token // cfg.num_layers,
                   "gpu_memory_after": gpu_memory()}
            # The request's metadata is still in place: time the choice as a step of the engine makes it.
            written = n // bs
            candidates = pages.candidates(written * pages_per_block, runner.budget_pages)
            position, tail_len, num_pages = jax.device_put(
                [np.int32(n), np.int32(n % bs), np.int32(written * pages_per_block)])
            q = jax.random.normal(jax.random.PRNGKey(1), (cfg.num_heads, cfg.head_dim), jnp.bfloat16)
            # Every sparse layer's scoring in one program, as each runs inside its layer's program in a step.
            score_once = jax.jit(lambda q, metas, num_pages, nc=candidates: [
                pages.scorer.page_scores(impl, q, meta, num_pages, nc) for meta in metas])
            metas = [pages.metadata(l) for l in layers]
            row["scoring_ms"] = timed(lambda: score_once(q, metas, num_pages))
            # A step pays the scoring inside its layers' programs, not as a call of its own: its GPU time is the
            # span of one call's kernels in a profiler trace.
            row["scoring_trace_ms"] = (stats(gpu_span_ms(lambda: score_once(q, metas, num_pages), 2 * a.repeats))
                                       if jax.default_backend() == "gpu" else None)

            def choose():
                return [page_choice_step(cfg, impl, params.layers[l], x, inv_freq, tail, position, tail_len,
                                         pages.scorer, pages.metadata(l), runner.budget_pages, a.page_size, bs,
                                         candidates, num_pages) for l in layers]

            row["choice_ms"] = timed(choose)
            rows.append(row)
            print(json.dumps(row), flush=True)  # before the read below, which holds a second copy of the KV
            if ctx == a.breakdown_ctx and read is None:
                choices = choose()
                store = runner.store
                store.mark_written(written)

                def read_all(store):
                    return [page_read_step(impl, q, store.layer_buffer(l), chosen_rows, num_keys, state, *store.gather_places(l))
                            for l, (q, _, state, chosen_rows, num_keys) in zip(layers, choices)]

                read = {"policy": policy, "ctx": n, "read_from_host_and_attend_ms": timed(lambda: read_all(store))}
                store.reset()
                device_llm = make(max_model_len=n + tokens + bs, **options(policy))
                pinned = device_llm._runner.store
                device_llm._runner.store = HostKVStore(pinned.num_layers, pinned.num_blocks, pinned.block_size,
                                                       cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16, pinned.tp,
                                                       pinned.places,
                                                       host_memory_kind="device")
                device_llm._runner.store.mark_written(written)
                read["attend_in_gpu_ms"] = timed(functools.partial(read_all, device_llm._runner.store))
                del device_llm, pinned, choices
                gc.collect()
        del llm, runner, pages
        gc.collect()
    n = a.breakdown_ctx
    full = make(max_model_len=max(n, warm_up_blocks * bs) + tokens + bs)
    warm_up(full)
    full_prefill_s, full_decode = run(full, n)
    print(json.dumps({"full_offloaded_decode_ms": full_decode, "full_prefill_s": full_prefill_s}), flush=True)
    return {"rows": rows, "read": read, "full": {"ctx": n, "decode_ms": full_decode, "prefill_s": full_prefill_s},
            "memory": memory, "budget": a.budget, "page_size": a.page_size, "dense_layers": a.dense_layers,
            "sketch_dtype": a.sketch_dtype}


def _timed(fn, reps: int) -> dict:
    return stats(call_seconds(fn, reps))


def _random_mask(rng, heads: int, nqb: int, density: float):
    """bool [1, heads, nqb, nqb]: per head and query block i, round(density x (i + 1)) of its causal key blocks
    (at least the sink and the diagonal), the rest drawn at random."""
    import numpy as np

    mask = np.zeros((1, heads, nqb, nqb), bool)
    for i in range(nqb):
        n = max(min(i + 1, 2), round(density * (i + 1)))
        extra = rng.random((heads, i + 1))
        extra[:, [0, i]] = -1.0  # forced ones sort first
        keep = np.argsort(extra, axis=1)[:, :n]
        np.put_along_axis(mask[0, :, i], keep, True, axis=1)
    return mask


def phase_xattn_kernel(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels
    from jax_offload.sparse import xattention

    cfg = model_config(a.shape, a.num_layers)
    t, hq, hkv, d, block = a.kernel_ctx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, XATTN_DEFAULTS["xattn_block"]
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(key[0], (1, t, hq, d), jnp.bfloat16)
    k = jax.random.normal(key[1], (1, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(key[2], (1, t, hkv, d), jnp.bfloat16)
    dense = jax.jit(lambda q, k, v: pallas_kernels.attention_with_lse(q, k, v, causal=True)[0])
    sparse = jax.jit(lambda q, k, v, blocks, counts: pallas_kernels.block_sparse_attention_with_lse(
        q, k, v, blocks, counts, block_size=block, causal=True)[0])
    rows = [{"density": "dense kernel", "s": _timed(lambda: dense(q, k, v), a.repeats)}]
    print(json.dumps(rows[-1]), flush=True)
    rng = np.random.default_rng(0)
    for density in a.densities:
        mask = _random_mask(rng, hq, t // block, density)
        blocks, counts = pallas_kernels.mask_to_block_lists(jnp.asarray(mask))
        vis = np.tril(np.ones((t // block, t // block), bool))
        rows.append({"density": density, "measured_density": float(mask.sum() / (vis.sum() * hq)),
                     "s": _timed(lambda: sparse(q, k, v, blocks, counts), a.repeats)})
        rows[-1]["speedup_vs_dense"] = rows[0]["s"]["median"] / rows[-1]["s"]["median"]
        print(json.dumps(rows[-1]), flush=True)
        del blocks, counts
    policy = xattention.XAttention(threshold=0.9, stride=XATTN_DEFAULTS["xattn_stride"], block=block)
    estimate = jax.jit(lambda q, k: xattention.select(policy, "pallas", q, k, q_offset=0, kv_len=t))
    est = {"s": _timed(lambda: estimate(q, k), a.repeats)}
    print(json.dumps(est), flush=True)
    return {"ctx": t, "heads": hq, "kv_heads": hkv, "head_dim": d, "block": block, "rows": rows,
            "estimate_one_layer": est}


def phase_xattn_prefill(a) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jax_offload import SamplingParams
    from jax_offload.sparse.xattention import XAttention

    m = RandomModel(a.shape, a.num_layers, min_positions=max(a.contexts) + a.block_size,
                    batch_invariant=a.batch_invariant)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for mode in a.xattn_modes:
        options = dict(max_model_len=max(a.contexts) + a.block_size, prefill_policy="xattention")
        if mode != "in_gpu":
            options.update(offload=True, block_size=a.block_size, num_ring_slots=a.ring_slots, prefill=mode)
        llm = m.llm(**options)
        runner = llm._runner
        for ctx in a.contexts:
            ids = m.prompt(ctx)
            for density in [None] + (a.densities if ctx == max(a.contexts) else [0.1]):
                runner.xattn = None if density is None else XAttention(
                    stride=XATTN_DEFAULTS["xattn_stride"], block=XATTN_DEFAULTS["xattn_block"], top_fraction=density)

                def prefill():
                    return llm.generate([ids], one)[0]

                prefill()  # warm-up at this shape
                outs = [prefill() for _ in range(a.repeats)]
                row = {"mode": mode, "ctx": ctx, "density": density,
                       "prefill_s": stats([o.prefill_seconds for o in outs]),
                       "pcie_GB": getattr(runner, "last_prefill_pcie_bytes", 0) / 1e9, "gpu_memory": gpu_memory()}
                if density is not None:
                    counts = np.asarray(jnp.stack(runner.prefill_block_counts)).astype(np.float64)
                    row["measured_density"] = float(counts[:, 0].sum() / counts[:, 1].sum())
                rows.append(row)
                print(json.dumps(row), flush=True)
        del llm, runner
    return {"rows": rows, "block_size": a.block_size, "ring_slots": a.ring_slots}


def report(sources: list[Path], out: Path) -> None:
    found = {p: next((src for src in sources if (src / f"phase_{p}.json").exists()), None) for p in PHASES}
    phases = {p: json.loads((src / f"phase_{p}.json").read_text()) for p, src in found.items() if src}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse.json").write_text(json.dumps(phases, indent=1))
    lines = ["# Sparse policies: Llama-3.1-8B shape, random bf16 weights", ""]
    dec = phases.get("decode")
    if dec:
        lines += _decode_section(dec)
    kernel = phases.get("xattn_kernel")
    if kernel:
        m = kernel["meta"]
        dense = kernel["rows"][0]["s"]
        lines += ["", f"## XAttention block-sparse kernel, causal, {kernel['ctx']} keys, {kernel['heads']} heads "
                  f"({kernel['kv_heads']} KV), head dim {kernel['head_dim']}, block {kernel['block']}, bf16",
                  "", f"{m['device']} | jax {m['jax']} | {m['date']}; seconds, median (min-max) of {dense['n']}", "",
                  "| causal blocks selected | kernel s | vs our dense causal kernel |", "|---|---|---|",
                  f"| dense kernel | {fmt(dense, digits=3)} | 1.00x |"]
        for r in kernel["rows"][1:]:
            lines.append(f"| {r['measured_density']:.1%} | {fmt(r['s'], digits=3)} | {r['speedup_vs_dense']:.2f}x |")
        lines += ["", f"The estimate of one layer (threshold 0.9, stride 8) at this length: "
                  f"{fmt(kernel['estimate_one_layer']['s'], digits=3)} s."]
    pre = phases.get("xattn_prefill")
    if pre:
        m = pre["meta"]
        lines += ["", "## Prefill, full and XAttention at fixed densities (top blocks by estimate), Llama-3.1-8B shape",
                  "", f"{m['device']} | jax {m['jax']} | {m['date']}; offloaded: block {pre['block_size']}, "
                  f"{pre['ring_slots']} ring slots; seconds, median (min-max) of {pre['rows'][0]['prefill_s']['n']} "
                  "after a warm-up", "",
                  "| mode | ctx | density asked | measured | prefill s | vs full, same mode | vs full chunked | host->GPU GB |",
                  "|---|---|---|---|---|---|---|---|"]
        full = {(r["mode"], r["ctx"]): r["prefill_s"]["median"] for r in pre["rows"] if r["density"] is None}
        for r in pre["rows"]:
            seconds = r["prefill_s"]["median"]
            base = full.get((r["mode"], r["ctx"]))
            chunked = full.get(("chunked", r["ctx"]))
            asked = "full" if r["density"] is None else f"{r['density']:.0%}"
            measured = "-" if r["density"] is None else f"{r['measured_density']:.1%}"
            vs_chunked = "-" if chunked is None else f"{chunked / seconds:.2f}x"
            lines.append(f"| {r['mode']} | {r['ctx']} | {asked} | {measured} | {fmt(r['prefill_s'])} | "
                         f"{base / seconds:.2f}x | {vs_chunked} | {r['pcie_GB']:.1f} |")
        if "runs" in pre:
            note = pre.get("runs_note", "Each mode ran in its own device call (same GPU model and software); 'vs full, "
                           "same mode' compares within one call, 'vs full chunked' across calls.")
            lines += ["", note + " Runs: " + "; ".join(f"{mode}: {when}" for mode, when in pre["runs"].items()) + "."]
    (out / "sparse.md").write_text("\n".join(lines) + "\n")
    import plots

    plots.sparse_decode(phases, out / "sparse.png")
    print("\n".join(lines))


def _decode_section(dec: dict) -> list[str]:
    m, full = dec["meta"], dec["full"]
    lines = [f"{m['device']} | jax {m['jax']} | {m['date']} | {batch_invariant_label(m)}", "",
             f"## Decode policies over the offloaded KV (budget {dec['budget']} tokens per KV head, page "
             f"{dec['page_size']}, {dec['dense_layers']} dense layers in GPU memory; sketch {dec['sketch_dtype']}), "
             "ms: medians (min-max) of every decode step, choice timings of "
             f"{m['repeats']} calls", "",
             "| policy | ctx | prefill s | decode ms/token | vs full at its ctx | scoring, all sparse layers, ms | "
             "the same, GPU time per token (trace), ms | the same by (t4 - t1) / 3, ms | q + scoring + top-k, ms | "
             "bytes moved per token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in dec["rows"]:
        # scoring_gpu_ms held the (t4 - t1) / 3 estimate before 2026-11-27 and the trace's span with the estimate
        # beside it that day; later files have the span alone, as scoring_trace_ms.
        if "scoring_trace_ms" not in r:
            dated = "scoring_by_repeats_ms" in r
            r = {**r, "scoring_trace_ms": r.get("scoring_gpu_ms") if dated else None,
                 "scoring_by_repeats_ms": r.get("scoring_by_repeats_ms", r.get("scoring_gpu_ms"))}
        vs = f"{full['decode_ms']['median'] / r['decode_ms']['median']:.1f}x" if r["ctx"] == full["ctx"] else "-"
        lines.append(f"| {r['policy']} | {r['ctx']} | {r['prefill_s']:.2f} | {fmt(r['decode_ms'])} | {vs} | "
                     f"{fmt(r['scoring_ms'])} | {fmt(r['scoring_trace_ms'])} | {fmt(r.get('scoring_by_repeats_ms'))} | "
                     f"{fmt(r['choice_ms'])} | "
                     f"{r['pcie_bytes_per_token'] / 2**20:.1f} MiB"
                     + (f", page cache hit {r['page_cache_hit_rate']:.1%}" if r.get("page_cache_hit_rate") is not None
                        else "") + " |")
    # Runs before this field existed have no full-policy prefill time.
    full_prefill = f" after a {full['prefill_s']:.2f} s prefill" if "prefill_s" in full else ""
    lines += ["", f"Full offloaded decode at {full['ctx']} tokens, same process: {fmt(full['decode_ms'])} ms/token"
                  f"{full_prefill}."]
    read = dec.get("read")
    if read:
        lines.append(f"Reading {read['policy']}'s chosen pages at {read['ctx']} tokens with attention over them, all "
                     f"sparse layers: from pinned host memory {fmt(read['read_from_host_and_attend_ms'])} ms, from GPU "
                     f"memory {fmt(read['attend_in_gpu_ms'])} ms (the difference is the transfer).")
    for policy, mem in dec["memory"].items():
        lines.append(f"GPU memory, {policy}: metadata {mem['metadata_GiB']:.2f} GiB for a "
                     f"{mem['host_store_GiB']:.1f} GiB host store, dense layers' KV {mem['dense_layers_gpu_GiB']:.2f} GiB.")
    return lines + [""]


def run_phase(a) -> None:
    result = globals()[f"phase_{a.run_phase}"](a)
    result["meta"] = run_metadata() | {"shape": a.shape, "repeats": a.repeats, "batch_invariant": a.batch_invariant}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"phase_{a.run_phase}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    p.add_argument("--phases", default="")
    p.add_argument("--run-phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, nargs="+")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--contexts", type=ints, default=[32768, 65536, 131072, 262144])
    p.add_argument("--breakdown-ctx", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=OFFLOAD_DEFAULTS["block_size"])
    p.add_argument("--ring-slots", type=int, default=OFFLOAD_DEFAULTS["num_ring_slots"])
    p.add_argument("--budget", type=int, default=PAGE_POLICY_DEFAULTS["decode_budget"])
    p.add_argument("--page-size", type=int, default=PAGE_POLICY_DEFAULTS["page_size"])
    p.add_argument("--dense-layers", type=int, default=PAGE_POLICY_DEFAULTS["dense_layers"])
    p.add_argument("--policies", type=lambda s: s.split(","), default=["sketch", "quest"])
    p.add_argument("--sketch-dtype", default=SKETCH_DEFAULTS["sketch_dtype"])
    p.add_argument("--sparse-cache-gb", type=float, default=0.0, help="the GPU cache of chosen pages (0: none)")
    p.add_argument("--decode-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    add_batch_invariant_option(p)
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--densities", type=floats, default=[0.05, 0.1, 0.2, 0.5, 1.0])
    p.add_argument("--kernel-ctx", type=int, default=131072)
    p.add_argument("--xattn-modes", type=lambda s: s.split(","), default=["in_gpu", "layerwise", "chunked"])
    a = p.parse_args()
    if a.report:
        report(a.report, a.out)
    elif a.run_phase:
        run_phase(a)
    else:
        run_phases(__file__, [(name, [name]) for name in a.phases.split(",") if name], a.phases)


if __name__ == "__main__":
    main()
