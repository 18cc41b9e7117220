"""How much of what sketch decode chooses at one step it chose at the step before (issue 63's page cache, measured
first): the reference engine of bench/eval_oracle.py on the real model, RULER NIAH prompts, the engine's sketch rule
(`sketch4bN`: int4 keys, 16-token pages, the first 2 layers dense) at several budgets.

Per prompt, sparse layer and KV head, with S_t the pages chosen at decode step t (page 0, which every step reads,
left out of every count):
  overlap     |S_t & S_t-1| / |S_t|, steps t >= 1
  hit rate    a least-recently-used cache of C pages per layer and KV head (C = factor x the budget's pages), filled
              by every step's choice: the share of S_t already in it, steps t >= 1 (the first step fills it). What
              crosses PCIe with such a cache is (1 - hit rate) of what crosses without it.

    python bench/probes/probe_page_overlap.py --lengths 4096,8192 --samples 5 \\
        --configs sketch4b256,sketch4b512,sketch4b1024 --out bench/results/runs/cpu_page_overlap
"""
from __future__ import annotations

import json
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eval_oracle  # noqa: E402
import eval_sparse  # noqa: E402

CACHE_FACTORS = (1.0, 1.5, 2.0)


def step_overlaps(trace: np.ndarray) -> list[float]:
    """trace [steps, Hkv, K] of one layer (-1: no page) -> |S_t & S_t-1| / |S_t| per step t >= 1 and head."""
    out = []
    for before, now in zip(trace[:-1], trace[1:]):
        for b, n in zip(before, now):
            now_set = set(n[n > 0].tolist())
            if now_set:
                out.append(len(now_set & set(b[b > 0].tolist())) / len(now_set))
    return out


def lru_hits(trace: np.ndarray, capacity: int) -> tuple[int, int]:
    """(hits, pages asked) of an LRU cache of `capacity` pages per head over steps t >= 1 of trace [steps, Hkv, K]."""
    hits = asked = 0
    for head in range(trace.shape[1]):
        cache: OrderedDict[int, None] = OrderedDict()
        for t, row in enumerate(trace[:, head]):
            pages = row[row > 0].tolist()
            if t:
                hits += sum(p in cache for p in pages)
                asked += len(pages)
            for p in pages:
                cache[p] = None
                cache.move_to_end(p)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits, asked


def main(argv: list[str] | None = None) -> int:
    p = eval_sparse.run_parser(__doc__, eval_oracle.parse_config, "sketch4b256,sketch4b512,sketch4b1024")
    args = p.parse_args(argv)
    configs = [eval_oracle.parse_config(name) for name in args.configs]
    if any(c.decode is None or c.prefill is not None for c in configs):
        p.error("every config is a decode rule alone (sketch4bN, questN, ...).")
    model_dir, dtype = eval_sparse.model_and_dtype(args)
    model = eval_oracle.load_model(model_dir, dtype)
    base = {"max_model_len": model.cfg.max_position_embeddings}
    targets = {n: eval_sparse.prompt_target(model_dir, base, n, args.max_tokens) for n in args.lengths}
    prompts = eval_sparse.build_prompts(model_dir, targets, args.samples, args.seed)
    rules = tuple(c.decode for c in configs)
    result = {"meta": eval_sparse.metadata(), "model": str(model_dir), "dtype": dtype, "samples": args.samples,
              "max_tokens": args.max_tokens, "page_size": eval_oracle.PAGE_SIZE, "cache_factors": CACHE_FACTORS,
              "lengths": {}}
    for n, ps in prompts.items():
        cache_len = -(-(targets[n] + args.max_tokens) // eval_oracle.CHUNK) * eval_oracle.CHUNK
        overlaps = [[] for _ in configs]
        hits = [[[0, 0] for _ in CACHE_FACTORS] for _ in configs]
        start = time.perf_counter()
        for prompt in ps:
            chosen: list[np.ndarray] = []
            eval_oracle.run_prompt(model, prompt, None, rules, args.max_tokens, cache_len, chosen)
            trace = np.stack(chosen)  # [steps, L, R, Hkv, K]
            for r, c in enumerate(configs):
                budget_pages = c.decode[1] // eval_oracle.PAGE_SIZE - 1  # page 0 left out
                for layer in range(c.decode[2], trace.shape[1]):
                    overlaps[r] += step_overlaps(trace[:, layer, r])
                    for f, factor in enumerate(CACHE_FACTORS):
                        h, a = lru_hits(trace[:, layer, r], int(factor * budget_pages))
                        hits[r][f][0] += h
                        hits[r][f][1] += a
        result["lengths"][str(n)] = {
            "prompts": len(ps), "prompt_tokens_at_most": targets[n], "seconds": round(time.perf_counter() - start, 1),
            "configs": {c.name: {"overlap_mean": float(np.mean(o)), "overlap_p10": float(np.percentile(o, 10)),
                                 "hit_rate": {str(f): h / a if a else None for f, (h, a) in zip(CACHE_FACTORS, hs)}}
                        for c, o, hs in zip(configs, overlaps, hits)}}
        print(json.dumps({n: result["lengths"][str(n)]}), flush=True)
        write(result, args.out)  # after each length: a stopped run keeps what it measured
    return 0


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "page_overlap.json").write_text(json.dumps(result, indent=1))
    (out / "page_overlap.md").write_text(report(result))


def report(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Step-to-step overlap of sketch decode's pages ({m.get('device', 'cpu')}, {r['dtype']} weights, "
             f"{m.get('date', '')})", "",
             f"The reference engine (bench/eval_oracle.py) on {Path(r['model']).name}, RULER NIAH, {r['samples']} prompts "
             f"per task, {r['max_tokens']} greedy tokens, {r['page_size']}-token pages, page 0 left out. Overlap: share "
             "of a step's pages chosen at the step before (mean, and the 10th percentile over steps, layers and KV "
             "heads). Hit rate: an LRU cache of factor x the budget's pages per layer and KV head.", "",
             "| length | prompts | config | overlap mean | overlap p10 | " +
             " | ".join(f"hit rate, cache {f}x" for f in r["cache_factors"]) + " |",
             "|---|---|---|---|---|" + "---|" * len(r["cache_factors"])]
    for n, x in r["lengths"].items():
        for name, c in x["configs"].items():
            lines.append(f"| {n} | {x['prompts']} | {name} | {c['overlap_mean']:.3f} | {c['overlap_p10']:.3f} | " +
                         " | ".join(f"{c['hit_rate'][str(f)]:.3f}" for f in r["cache_factors"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
