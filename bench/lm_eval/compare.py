"""Compare two lm-eval runs item by item: `--model hf` (reference) against `--model local-completions` (our server).

usage: python bench/lm_eval/compare.py REF_DIR RUN_DIR [--out bench/results/lm_eval/compare.md] [--rtol 1e-4]

Each DIR is an lm-eval --output_path; its newest samples_<task>_*.jsonl[.gz] per task is read (recursively).
Checks, per task: the same docs and request arguments; loglikelihood tasks: every choice's loglikelihood within
rtol relative (|a - b| <= rtol * |a| + 1e-6), the same is_greedy flags, the same chosen answer and per-item acc;
generate_until tasks: the identical generated text and per-item metric. Then the accuracy of the two runs is identical.
Writes a Markdown report and exits 1 on any difference.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

METRICS = ("acc", "acc_norm", "exact_match")


def samples(run_dir: Path) -> dict[str, dict[int, dict]]:
    newest: dict[str, Path] = {}
    for p in sorted(run_dir.rglob("samples_*.jsonl*"), key=lambda p: p.name):
        newest[p.name.removeprefix("samples_").rsplit("_", 1)[0]] = p  # timestamps sort, so the last one wins
    out = {}
    for task, p in newest.items():
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:
            out[task] = {(s := json.loads(line))["doc_id"]: s for line in f if line.strip()}
    return out


def metric_of(s: dict) -> tuple[str, float]:
    name = next(m for m in METRICS if m in s)
    return name, float(s[name])


def compare_task(ref: dict[int, dict], run: dict[int, dict], rtol: float) -> tuple[list[str], dict]:
    problems, worst = [], 0.0
    if set(ref) != set(run):
        problems.append(f"doc ids differ: only ref {sorted(set(ref) - set(run))[:5]}, only run {sorted(set(run) - set(ref))[:5]}")
    for i in sorted(set(ref) & set(run)):
        a, b = ref[i], run[i]
        if a["doc"] != b["doc"] or a["arguments"] != b["arguments"]:
            problems.append(f"doc {i}: different doc or request arguments")
            continue
        ra, rb = a["filtered_resps"], b["filtered_resps"]
        if isinstance(ra[0], list):  # loglikelihood: [[ll, is_greedy], ...] per choice
            for c, ((lla, ga), (llb, gb)) in enumerate(zip(ra, rb, strict=True)):
                lla, llb = float(lla), float(llb)
                rel = abs(lla - llb) / max(abs(lla), 1e-12)
                worst = max(worst, rel)
                if abs(lla - llb) > rtol * abs(lla) + 1e-6:
                    problems.append(f"doc {i} choice {c}: loglikelihood {lla!r} vs {llb!r} (rel {rel:.2e})")
                if str(ga) != str(gb):
                    problems.append(f"doc {i} choice {c}: is_greedy {ga} vs {gb}")
            pick = [max(range(len(r)), key=lambda c, r=r: float(r[c][0])) for r in (ra, rb)]
            if pick[0] != pick[1]:
                problems.append(f"doc {i}: chosen answer {pick[0]} vs {pick[1]}")
        elif ra != rb:
            problems.append(f"doc {i}: generation {ra[0]!r} vs {rb[0]!r}")
        if metric_of(a) != metric_of(b):
            problems.append(f"doc {i}: {metric_of(a)} vs {metric_of(b)}")
    name = metric_of(next(iter(ref.values())))[0]
    score = [sum(metric_of(s)[1] for s in d.values()) / len(d) for d in (ref, run)]
    if score[0] != score[1]:
        problems.append(f"{name}: {score[0]!r} vs {score[1]!r}")
    return problems, {"items": len(ref), "metric": name, "ref": score[0], "run": score[1], "max_rel_ll": worst}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", type=Path, help="lm-eval output_path of the --model hf run")
    ap.add_argument("run", type=Path, help="lm-eval output_path of the --model local-completions run")
    ap.add_argument("--out", type=Path, default=Path("bench/results/lm_eval/compare.md"))
    ap.add_argument("--rtol", type=float, default=1e-4)
    args = ap.parse_args()
    ref, run = samples(args.ref), samples(args.run)
    if not ref or set(ref) != set(run):
        print(f"tasks differ or missing: ref {sorted(ref)}, run {sorted(run)}", file=sys.stderr)
        return 1
    lines = [f"# lm-eval: `{args.run}` against `{args.ref}`", "",
             f"Per item: same docs and requests; loglikelihoods within {args.rtol:g} relative, same is_greedy and chosen "
             "answer; identical generations; same per-item metric. Per task: identical accuracy.", "",
             "| task | items | metric | reference | server | max rel. loglikelihood diff | differences | verdict |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    details, ok = [], True
    for task in sorted(ref):
        problems, s = compare_task(ref[task], run[task], args.rtol)
        ok &= not problems
        ll = f"{s['max_rel_ll']:.2e}" if s["max_rel_ll"] else "-"
        lines.append(f"| {task} | {s['items']} | {s['metric']} | {s['ref']:.4f} | {s['run']:.4f} | {ll} | "
                     f"{len(problems)} | {'PASS' if not problems else 'FAIL'} |")
        details += [f"- {task}: {p}" for p in problems[:20]] + ([f"- {task}: ... {len(problems) - 20} more"] if len(problems) > 20 else [])
    lines += ["", f"Overall: {'PASS' if ok else 'FAIL'}"] + (["", "## Differences", ""] + details if details else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
