"""The benchmarks' plots: one function per plot, each drawn from result files and written as a PNG beside them.
The bench scripts call theirs when they write a report; `python -m bench.plots` redraws every plot of
bench/results/ from the files there (decode_vs_context.png, joining three scripts' runs, is drawn only here).
Each plot's figures come from one device, named in its title.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import read_json, result_files  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "runs"
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _one_device(*files: dict) -> str:
    """The device every file's run was on; a plot mixing devices would compare unlike figures."""
    devices = {f["meta"]["device"] for f in files}
    if len(devices) != 1:
        raise ValueError(f"one plot, one device: these files come from {sorted(devices)}")
    return devices.pop()


def _plain_log_ticks(ax, contexts: list[int] | None = None) -> None:
    """Plain labels on log axes: round values (1, 2, 5 x 10^k) on y and, given, the contexts as 8K, 32K, ... on x."""
    if contexts:
        ax.set_xticks(contexts, [f"{n // 1024}K" for n in contexts])
    low, high = ax.get_ylim()
    ticks = [m * 10**k for k in range(-1, 6) for m in (1, 2, 5) if low <= m * 10**k <= high]
    ax.set_yticks(ticks, [f"{v:g}" for v in ticks])
    ax.minorticks_off()


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sparse_decode(phases: dict, path: Path, quest_more: list[dict] = ()) -> None:
    """bench_sparse.py's sparse.png: one panel per phase present: decode policies' ms/token against context (and
    Quest's older phase with the rows of `quest_more`, its later calls), prefill seconds full and XAttention at 10%
    per mode."""
    q, pre, dec = phases.get("quest"), phases.get("xattn_prefill"), phases.get("decode")
    panels = [name for name, phase in (("decode", dec), ("quest", q), ("prefill", pre)) if phase]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    for name, phase in (("decode", dec), ("quest", q)):
        if not phase:
            continue
        ax = axes[name]
        rows = phase["rows"] + [r for e in (quest_more if name == "quest" else []) for r in e["rows"]]
        for policy in dict.fromkeys(r.get("policy", "quest") for r in rows):
            mine = sorted((r for r in rows if r.get("policy", "quest") == policy), key=lambda r: r["ctx"])
            ax.plot([r["ctx"] for r in mine], [r["decode_ms"]["median"] for r in mine], "o-",
                    label=f"{'Quest' if policy == 'quest' else policy}, budget {phase['budget']}")
        full = phase["full"] if name == "decode" else {"ctx": phase["breakdown"]["ctx"],
                                                       "decode_ms": phase["breakdown"]["full_offloaded_decode_ms"]}
        ax.plot([full["ctx"]], [full["decode_ms"]["median"]], "s", label="full offloaded decode")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms / token",
               title=f"Offloaded decode, 8B shape, {phase['meta']['device']}")
        _plain_log_ticks(ax, sorted({r["ctx"] for r in rows}))
        ax.legend()
    if pre:
        ax = axes["prefill"]
        for mode in dict.fromkeys(r["mode"] for r in pre["rows"]):
            for density, style in ((None, "o-"), (0.1, "s--")):
                rows = [r for r in pre["rows"] if r["mode"] == mode and r["density"] == density]
                ax.plot([r["ctx"] for r in rows], [r["prefill_s"]["median"] for r in rows], style,
                        label=f"{mode}, {'full' if density is None else 'XAttention 10%'}")
        ax.set(xscale="log", yscale="log", xlabel="prompt (tokens)", ylabel="prefill s",
               title=f"Prefill, 8B shape, {pre['meta']['device']}")
        _plain_log_ticks(ax, sorted({r["ctx"] for r in pre["rows"]}))
        ax.legend(fontsize=7)
    _save(fig, path)


def niah_by_budget(niah: dict[int, list[dict]], path: Path) -> None:
    """eval_sparse.py's sparse_niah.png: mean NIAH score against the Quest budget and the XAttention threshold
    (a panel for each present), one line per length; dotted: the oracles (eval_oracle.py); dashed: full."""
    series: dict[str, list] = {"decode": [], "prefill": []}  # panel -> (length, label, style, points)
    for n, results in niah.items():
        for policy, style, label in (("quest", "o-", ""), ("quest_oracle", "s:", ", oracle")):
            points = sorted((r["options"]["decode_budget"], r["mean_score"]) for r in results
                            if r["options"].get("decode_policy") == policy and "xattn_threshold" not in r["options"])
            series["decode"] += [(n, f"{n} tokens{label}", style, points)] if points else []
        for rule, style, label in (("xattn", "o-", ""), ("xoracle", "s:", ", oracle")):
            points = sorted((r["options"]["xattn_threshold"], r["mean_score"]) for r in results
                            if r["options"].get("prefill_rule", "xattn") == rule and "xattn_threshold" in r["options"]
                            and "decode_policy" not in r["options"])
            series["prefill"] += [(n, f"{n} tokens{label}", style, points)] if points else []
    panels = [name for name, lines in series.items() if lines] or ["decode"]
    devices = ", ".join(sorted({r["meta"]["device"] for rs in niah.values() for r in rs}))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for (n, results), color in zip(niah.items(), COLORS * 4):
            for _, label, style, points in (s for s in series[panel] if s[0] == n):
                ax.plot(*zip(*points), style, color=color, label=label)
            full = next((r["mean_score"] for r in results if r["config"] == "full"), None)
            if full is not None:
                ax.axhline(full, color=color, linestyle="--", linewidth=1, label=f"{n} tokens, full")
        if panel == "decode":
            ax.set_xscale("log", base=2)
            budgets = sorted({x for *_, points in series[panel] for x, _ in points})
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set(xlabel="Quest decode budget (tokens per KV head)" if panel == "decode" else "XAttention threshold",
               ylabel="mean NIAH score", title=f"{'Quest decode' if panel == 'decode' else 'XAttention prefill'}, "
                                                f"{devices}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def niah_by_task(niah: dict[int, list[dict]], path: Path, labels: dict[str, str] | None = None,
                 what: str = "") -> None:
    """NIAH score per task, one bar per config (those of `labels`, named by it, else every config), one panel
    per length; `what` names the model and engine in the title."""
    configs = list(labels or dict.fromkeys(r["config"] for rs in niah.values() for r in rs))
    color = dict(zip(configs, COLORS * 4))  # a config keeps its colour in every panel
    fig, axes = plt.subplots(len(niah), 1, figsize=(11, 3.4 * len(niah) + 0.6), squeeze=False)
    for ax, (n, results) in zip(axes[:, 0], niah.items()):
        shown = sorted((r for r in results if r["config"] in color), key=lambda r: configs.index(r["config"]))
        tasks = list(dict.fromkeys(t for r in shown for t in r["scores"]))
        width = 0.8 / len(shown)
        for i, r in enumerate(shown):
            scores = [r["scores"].get(t, 0.0) for t in tasks] + [r["mean_score"]]
            ax.bar([x + (i - (len(shown) - 1) / 2) * width for x in range(len(scores))], scores, width,
                   color=color[r["config"]])
        ax.set_xticks(range(len(tasks) + 1), [t.removeprefix("niah_") for t in tasks] + ["mean"], fontsize=8)
        prompts = len(shown[0]["records"]) // max(len(tasks), 1)
        ax.set(ylabel="score (string_match_all)", ylim=(0, 105), title=f"{n} tokens, {prompts} prompts per task")
        ax.grid(axis="y", alpha=0.3)
    devices = ", ".join(sorted({r["meta"]["device"] for rs in niah.values() for r in rs}))
    fig.suptitle(f"RULER NIAH score per task{what}, {devices}", fontsize=11)
    handles = [matplotlib.patches.Patch(color=color[c], label=(labels or {}).get(c, c)) for c in configs]
    fig.legend(handles=handles, loc="lower center", ncols=min(len(configs), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (len(configs) > 6), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode_vs_context(offload: dict, path: Path, sparse: list[dict] = (), batch1: dict | None = None) -> None:
    """Decode ms/token against context, Llama-3.1-8B shape, bf16, batch 1, from bench_offload.py's phases
    `offload` (full offloaded with its PCIe floor: the host blocks at the measured pinned-copy rate; KV in GPU
    memory; transformers' caches), with bench_sparse.py's decode phases `sparse` (sketch, Quest) and, from
    bench_throughput.py's `batch1` phase, the HBM floor of in-GPU decode (weights and KV read once at the measured
    bandwidth). bench_offload.py draws offload.png from its phases alone."""
    chunked, in_gpu = offload["chunked"], offload.get("in_gpu")
    device = _one_device(*(p for p in offload.values() if p.get("rows")), *sparse, *([batch1] if batch1 else []))
    kv_tok, block = chunked["kv_bytes_per_token"], chunked["meta"]["block_size"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ctx = [r["ctx"] for r in chunked["rows"]]
    ax.plot(ctx, [r["decode_ms"]["median"] for r in chunked["rows"]], "o-", color=COLORS[0],
            label=f"full, offloaded ({chunked['meta']['ring_slots']} ring slots)")
    ax.plot(ctx, [r["host_blocks"] * block * kv_tok / chunked["h2d_Bps"]["median"] * 1e3 for r in chunked["rows"]],
            "--", color=COLORS[0], label=f"PCIe floor ({chunked['h2d_Bps']['median'] / 1e9:.0f} GB/s pinned copy)")
    for policy, color in (("sketch", COLORS[1]), ("quest", COLORS[2])):
        rows = sorted((r for s in sparse for r in s["rows"] if r["policy"] == policy), key=lambda r: r["ctx"])
        if rows:
            ax.plot([r["ctx"] for r in rows], [r["decode_ms"]["median"] for r in rows], "o-", color=color,
                    label=f"{'Quest' if policy == 'quest' else policy}, offloaded, budget {sparse[0]['budget']}")
    if in_gpu:
        ax.plot([r["ctx"] for r in in_gpu["rows"]], [r["decode_ms"]["median"] for r in in_gpu["rows"]], "s",
                color=COLORS[3], markersize=8, label="full, KV in GPU memory")
    for cache, color in (("dynamic", COLORS[4]), ("offloaded", COLORS[5])):
        rows = [r for r in offload.get("hf", {}).get("rows", []) if r.get("cache") == cache and "error" not in r]
        if rows:
            ax.plot([r["ctx"] for r in rows], [r["decode_ms"]["median"] for r in rows], "s:", color=color,
                    label=f"transformers, {cache} cache")
    grid = sorted({*ctx, *(r["ctx"] for s in sparse for r in s["rows"])})
    if batch1:
        bw = (batch1.get("read_bandwidth") or batch1["copy_bandwidth"])["median"]
        weights = batch1["floor_seconds"] * bw - batch1["context"] * kv_tok  # the weight bytes a step reads
        ax.plot(grid, [(weights + n * kv_tok) / bw * 1e3 for n in grid], ":", color=COLORS[3],
                label=f"HBM floor, KV in GPU memory ({bw / 1e12:.1f} TB/s copy)")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode ms / token (median of steps)",
           title=f"Decode against context: Llama-3.1-8B shape, bf16, batch 1\n{device}")
    _plain_log_ticks(ax, grid)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, path)


def throughput(sources: list[Path], path: Path) -> None:
    """bench_throughput.py: output tokens/s of ours and transformers' continuous batching on the same requests
    (nano-vllm's workload), each shape and request count both ran; a later folder's file replaces an earlier's."""
    paths = {p.name: p for src in sources for p in result_files(src, "phase_*.json")}
    phases = {name.removesuffix(".gz").removesuffix(".json").removeprefix("phase_"): read_json(p)
              for name, p in paths.items()}
    peers = {(p["shape"], p["requests"]): p for k, p in phases.items() if k.startswith("hf_") and "requests" in p}
    pairs = [(ours, peers[(ours["shape"], ours["requests"])]) for k, ours in sorted(phases.items())
             if k.startswith("ours_") and (ours["shape"], ours["requests"]) in peers]
    if not pairs:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (ours, hf) in enumerate(pairs):
        a, b = ours["output_tokens_per_second"]["median"], hf["output_tokens_per_second"]["median"]
        ax.bar([i - 0.2], [a], 0.4, color=COLORS[0], label="ours" if i == 0 else None)
        ax.bar([i + 0.2], [b], 0.4, color=COLORS[1], label="transformers" if i == 0 else None)
        ax.text(i, a * 1.15, f"{a / b:.1f}x", ha="center", fontsize=9)
    ax.set_xticks(range(len(pairs)), [f"{o['shape']}\n{o['requests']} requests" for o, _ in pairs])
    ax.set(yscale="log", ylim=(None, max(o["output_tokens_per_second"]["median"] for o, _ in pairs) * 3),
           ylabel="output tokens / s (median of runs)",
           title=f"Continuous batching against transformers', {_one_device(*(p for pair in pairs for p in pair))}")
    _plain_log_ticks(ax)
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def tensor_parallel(src: Path, path: Path) -> None:
    """bench_tp.py: TP=1 against TP=2 for offloaded decode (with each one's PCIe floor), in-GPU decode and
    in-GPU prefill, from the phase files of `src`."""
    phases = {p.name.removesuffix(".json")[len("phase_"):]: read_json(p) for p in src.glob("phase_*_tp*.json")}
    offload = [phases.get(f"offload_tp{n}") for n in (1, 2)]
    in_gpu = [phases.get(f"in_gpu_tp{n}") for n in (1, 2)]
    panels = []
    if all(offload):
        panels.append((f"offloaded decode, {offload[0]['rows'][0]['prompt_tokens']} tokens", "ms / token",
                       [p["rows"][0]["decode_ms"]["median"] for p in offload],
                       [p["rows"][0]["floor_ms"] for p in offload]))
    if all(in_gpu):
        panels.append((f"in-GPU decode, {in_gpu[0]['decode']['ctx']} tokens", "ms / token",
                       [p["decode"]["decode_ms"]["median"] for p in in_gpu], None))
        panels.append((f"in-GPU prefill, {in_gpu[0]['prefill']['ctx']} tokens", "s",
                       [p["prefill"]["prefill_s"]["median"] for p in in_gpu], None))
    if not panels:
        return
    device = _one_device(*(p for p in offload + in_gpu if p))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.8), squeeze=False)
    for ax, (title, unit, values, floors) in zip(axes[0], panels):
        ax.bar(["TP=1", "TP=2"], values, 0.6, color=COLORS[:2])
        if floors:
            ax.plot(["TP=1", "TP=2"], floors, "k_", markersize=30, markeredgewidth=2, label="PCIe floor")
            ax.legend(fontsize=8)
        top = max(values + (floors or []))
        ax.text(1, max(values[1], floors[1] if floors else 0) + 0.03 * top, f"{values[1] / values[0]:.2f}x TP=1",
                ha="center", va="bottom", fontsize=9)
        ax.set(title=title, ylabel=f"{unit} (median)", ylim=(0, 1.15 * top))
        ax.title.set_fontsize(9)
    fig.suptitle(f"Llama-3.1-8B shape, bf16: TP=2 against TP=1, {offload[0]['meta']['devices'] if offload[0] else 2}"
                 f" x {device}", fontsize=10)
    _save(fig, path)


def main() -> None:
    from eval_sparse import load_results

    offload = read_json(RESULTS / "offload.json")
    decode_vs_context(offload, RESULTS / "offload.png")
    decode_vs_context({k: offload[k] for k in ("chunked", "in_gpu")}, RESULTS / "decode_vs_context.png",
                      [read_json(RUNS / "h100_sketch_decode_launch" / f) for f in ("phase_decode.json",
                                                                                   "more_256k/phase_decode.json")],
                      read_json(RUNS / "h100_batch1" / "phase_batch1_llama-3.1-8b.json"))
    sparse_decode(read_json(RESULTS / "sparse.json"), RESULTS / "sparse.png",
                  [read_json(RUNS / "h200_quest_zero_copy" / "phase_quest_more_256k.json")])
    for mode in ("in_gpu", "offloaded"):
        niah_by_budget(load_results(RUNS / "h100_sparse" / f"niah_{mode}")[0],
                       RESULTS / "sparse_niah" / mode / "sparse_niah.png")
    niah_by_task(load_results(RUNS / "h100_sketch_oracle")[0], RUNS / "h100_sketch_oracle" / "niah_by_task.png",
                 {"full": "full", "sketch4b1024": "sketch, budget 1024", "sketch4b512": "sketch, budget 512",
                  "quest1024": "Quest, budget 1024", "quest512": "Quest, budget 512"},
                 ", SmolLM2-135M-Instruct on eval_oracle.py's reference engine")
    throughput([RUNS / f"h200_throughput_{n}" for n in (2, 3, 4)], RESULTS / "throughput.png")
    tensor_parallel(RUNS / "h200x2_tp_ring32", RUNS / "h200x2_tp_ring32" / "tp.png")


if __name__ == "__main__":
    main()
