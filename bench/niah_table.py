"""Assemble the RULER NIAH result files of `python -m jax_offload.eval.niah --out` into one table.

    python bench/niah_table.py bench/results/niah/*.json > bench/results/niah/table.md

Each file's engine is read from its config (torch; ours in-GPU; ours offloaded with its block size,
ring slots and prefill mode). Several files may hold parts of one engine's results; a prompt is
identified by (task, length, index). Besides the scores, the table says output for output how the
engines agree, since the same prompt ids went to every engine.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import read_json  # noqa: E402  (also puts the repository root on sys.path)

from jax_offload.eval.ruler import TASKS  # noqa: E402

IN_GPU, TORCH = "ours in-GPU", "transformers (torch)"


def engine_label(config: dict) -> str:
    if config["backend"] == "torch":
        return TORCH
    opts = config["engine_options"]
    if not opts.get("offload"):
        return IN_GPU
    return f"ours offloaded (block {opts['block_size']}, {opts['num_ring_slots']} slots, {opts['prefill']})"


def stop_token_ids(model_dir: str) -> set[int]:
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def load(paths: list[Path]) -> dict[str, dict]:
    """-> {engine: {(task, length, index): record}}."""
    records: dict[str, dict] = defaultdict(dict)
    for path in paths:
        data = read_json(path)
        label = engine_label(data["config"])
        # Files written before the torch backend dropped generate's stop token still end with it.
        stops = set() if data["config"].get("stop_token_in_output_ids") is False else stop_token_ids(data["config"]["model"])
        for r in data["records"]:
            if r["output_token_ids"] and r["output_token_ids"][-1] in stops:
                r["output_token_ids"] = r["output_token_ids"][:-1]
            key = (r["task"], r["length"], r["index"])
            if key in records[label] and records[label][key]["output_token_ids"] != r["output_token_ids"]:
                raise ValueError(f"{path}: {label} has two different outputs for {key}.")
            records[label][key] = r
    return records


def cell_score(records: dict, task: str, length: int) -> tuple[float, int] | None:
    """string_match_all over the cell's records -> (score, samples), or None if the cell was not run."""
    rs = [r for (t, n, _), r in records.items() if t == task and n == length]
    if not rs:
        return None
    found = [sum(a.lower() in r["output"].lower() for a in r["answers"]) / len(r["answers"]) for r in rs]
    return 100.0 * sum(found) / len(found), len(rs)


def same_outputs(a: dict, b: dict, length: int) -> tuple[int, int]:
    keys = [k for k in a if k[1] == length and k in b]
    return sum(a[k]["output_token_ids"] == b[k]["output_token_ids"] for k in keys), len(keys)


def render(records: dict) -> str:
    engines = [e for e in (IN_GPU,) if e in records]
    engines += sorted(e for e in records if e not in (IN_GPU, TORCH))
    engines += [e for e in (TORCH,) if e in records]
    lengths = sorted({k[1] for r in records.values() for k in r})
    lines = []
    for length in lengths:
        present = [e for e in engines if any(k[1] == length for k in records[e])]
        tasks = [t for t in TASKS if any(cell_score(records[e], t, length) for e in present)]
        lines += [f"### {length} tokens", "", "| task | " + " | ".join(present) + " |",
                  "|---|" + "---:|" * len(present)]
        sums = defaultdict(float)
        for task in tasks:
            cells = []
            for e in present:
                sc = cell_score(records[e], task, length)
                cells.append("-" if sc is None else f"{sc[0]:.1f} ({sc[1]})")
                sums[e] += sc[0] if sc else float("nan")
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
        lines.append("| **mean** | " + " | ".join(f"{sums[e] / len(tasks):.1f}" for e in present) + " |")
        lines.append("")
        for e in present:
            for ref in (IN_GPU, TORCH):
                if e != ref and ref in present and not (e == TORCH and ref == IN_GPU):
                    same, total = same_outputs(records[e], records[ref], length)
                    lines.append(f"- {e} vs {ref}: identical output token ids on {same}/{total} prompts.")
        for e in present:
            if e == TORCH or TORCH not in present:
                continue
            gaps = []
            for task in tasks:
                ours, ref = cell_score(records[e], task, length), cell_score(records[TORCH], task, length)
                if ours and ref:
                    gaps.append(abs(ours[0] - ref[0]) * ref[1] / 100.0)
            within = sum(g <= 1.0 + 1e-9 for g in gaps)
            lines.append(f"- {e} vs {TORCH}: |score difference| <= 1 sample in {within}/{len(gaps)} cells "
                         f"(largest {max(gaps, default=0.0):.2f} samples).")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="JSON files (or .json.gz) written by jax_offload.eval.niah --out")
    args = ap.parse_args(argv)
    records = load(args.files)
    print(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
