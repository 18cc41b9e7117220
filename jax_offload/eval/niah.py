"""Command line: `python -m jax_offload.eval.niah` runs RULER-style NIAH tasks on the jax engine or
on transformers (torch, CPU) and prints a task x length table of string_match_all scores.

Both backends see the same prompt token ids, built once with the model directory's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from jax_offload.config import DECODE_POLICIES, SKETCH_DTYPES
from jax_offload.eval.ruler import TASKS, make_samples, score_string_match_all

BACKENDS = ("jax", "torch")
Generate = Callable[[list[int]], tuple[str, list[int]]]


def _jax_backend(model_dir: Path, max_tokens: int, engine_options: dict[str, Any]) -> Generate:
    from jax_offload import LLM, SamplingParams

    llm = LLM(model_dir, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def generate(ids: list[int]) -> tuple[str, list[int]]:
        out = llm.generate([ids], params)[0]
        return out.text, list(out.token_ids)

    return generate


def _torch_backend(model_dir: Path, max_tokens: int, engine_options: dict[str, Any]) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    unsupported = sorted(set(engine_options) - {"dtype"})
    if unsupported:
        raise ValueError(f"Engine option{'s' if len(unsupported) > 1 else ''} {', '.join(unsupported)} "
                         f"appl{'y' if len(unsupported) > 1 else 'ies'} only to the jax backend; the torch backend "
                         "takes only dtype.")
    dtype_name = engine_options.get("dtype", "float32")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype_name not in dtypes:
        raise ValueError(f"dtype {dtype_name!r} is not one of {sorted(dtypes)}.")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtypes[dtype_name], use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id  # what generate stops on
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def generate(ids: list[int]) -> tuple[str, list[int]]:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        new = out[0, len(ids):].tolist()
        if new and new[-1] in eos_ids:  # generate keeps the stop token; our engine does not
            new = new[:-1]
        return tokenizer.decode(new, skip_special_tokens=True), new

    return generate


def run_niah(
    engine_kind: str,
    model_dir: str | Path,
    tasks: list[str],
    lengths: list[int],
    samples: int,
    seed: int,
    max_tokens: int,
    engine_options: dict[str, Any],
    chat_template: bool = False,
) -> dict[str, Any]:
    """Generate every (task, length) cell's prompts, run them greedily and score them.

    Returns {"config", "scores": {task: {length: score}}, "records": [...]}; each record holds the
    prompt's task, length, index, expected answers, needle depths, output text and token ids."""
    if engine_kind not in BACKENDS:
        raise ValueError(f"Unknown backend {engine_kind!r}; valid backends are: {', '.join(BACKENDS)}.")
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cells = {(t, n): make_samples(t, tokenizer, n, samples, seed, chat_template) for t in tasks for n in lengths}
    backend = _jax_backend if engine_kind == "jax" else _torch_backend
    generate = backend(model_dir, max_tokens, engine_options)

    records: list[dict[str, Any]] = []
    scores: dict[str, dict[str, float]] = {t: {} for t in tasks}
    with tqdm(total=sum(len(s) for s in cells.values()), desc=f"niah[{engine_kind}]", unit="prompt") as bar:
        for (task, length), cell in cells.items():
            outputs = []
            for sample in cell:
                start = time.perf_counter()
                text, token_ids = generate(sample.prompt_ids)
                records.append({
                    "task": task,
                    "length": length,
                    "index": sample.index,
                    "prompt_tokens": sample.length,
                    "answers": sample.answers,
                    "depths": sample.depths,
                    "output": text,
                    "output_token_ids": token_ids,
                    "seconds": round(time.perf_counter() - start, 4),
                })
                outputs.append(text)
                bar.update()
            scores[task][str(length)] = score_string_match_all(outputs, [s.answers for s in cell])

    config = {
        "backend": engine_kind,
        "model": str(model_dir),
        "tasks": list(tasks),
        "lengths": list(lengths),
        "samples": samples,
        "seed": seed,
        "max_tokens": max_tokens,
        "chat_template": chat_template,
        "engine_options": dict(engine_options),
        "stop_token_in_output_ids": False,
    }
    return {"config": config, "scores": scores, "records": records}


def format_table(scores: dict[str, dict[str, float]], lengths: list[int]) -> str:
    """Markdown table: one row per task, one column per length, and a mean row."""
    header = "| task | " + " | ".join(str(n) for n in lengths) + " |"
    rows = [header, "|---|" + "---:|" * len(lengths)]
    for task, by_len in scores.items():
        rows.append(f"| {task} | " + " | ".join(f"{by_len[str(n)]:.1f}" for n in lengths) + " |")
    means = [sum(s[str(n)] for s in scores.values()) / len(scores) for n in lengths]
    rows.append("| **mean** | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    return "\n".join(rows)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int_list(text: str) -> list[int]:
    """argparse type: "1024,2048" -> [1024, 2048], positive integers only."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def _task_list(text: str) -> list[str]:
    if text == "all":
        return list(TASKS)
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(f"unknown task(s) {unknown or text!r}; valid: all, {', '.join(TASKS)}")
    return tasks


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(prog="python -m jax_offload.eval.niah", description=__doc__)
    p.add_argument("--model", type=Path, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tasks", type=_task_list, default=list(TASKS), help="comma-separated task names, or all (default)")
    p.add_argument("--lengths", type=positive_int_list, default=[1024], help="comma-separated prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=10, help="prompts per task and length")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--backend", choices=BACKENDS, default="jax")
    p.add_argument("--out", type=Path, help="write the full results as JSON here")
    p.add_argument("--chat-template", action="store_true", help="wrap the task in the model's chat template (default: bare prompt)")
    engine = p.add_argument_group("engine options (passed to LLM; omitted ones keep its defaults)")
    engine.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on GPU, float32 on CPU; torch: float32)")
    engine.add_argument("--max-model-len", type=int, dest="max_model_len")
    engine.add_argument("--offload", action="store_true", default=None)
    engine.add_argument("--block-size", type=int, dest="block_size")
    engine.add_argument("--ring-slots", type=int, dest="num_ring_slots")
    engine.add_argument("--prefill", choices=("chunked", "layerwise"))
    engine.add_argument("--decode-policy", dest="decode_policy", choices=DECODE_POLICIES)
    engine.add_argument("--sparse-policy", dest="decode_policy", help=argparse.SUPPRESS)  # the old name
    engine.add_argument("--decode-budget", type=int, dest="decode_budget")
    engine.add_argument("--page-size", type=int, dest="page_size")
    engine.add_argument("--dense-layers", type=int, dest="dense_layers")
    engine.add_argument("--sketch-dtype", dest="sketch_dtype", choices=SKETCH_DTYPES)
    engine.add_argument("--prefill-policy", dest="prefill_policy", choices=("full", "xattention"))
    engine.add_argument("--xattn-threshold", type=float, dest="xattn_threshold")
    engine.add_argument("--xattn-stride", type=int, dest="xattn_stride")
    engine.add_argument("--xattn-block", type=int, dest="xattn_block")
    return p


ENGINE_OPTIONS = ("dtype", "max_model_len", "offload", "block_size", "num_ring_slots", "prefill", "decode_policy",
                  "decode_budget", "page_size", "dense_layers", "sketch_dtype", "prefill_policy", "xattn_threshold", "xattn_stride",
                  "xattn_block")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.samples < 1:
        print(f"error: --samples must be >= 1, got {args.samples}", file=sys.stderr)
        return 2
    engine_options = {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None}
    if args.backend == "jax" and "dtype" not in engine_options:
        import jax

        engine_options["dtype"] = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    if args.model is not None:
        model_dir = args.model
    else:
        from jax_offload.default_model import ensure_default_model

        model_dir = ensure_default_model()
    try:
        result = run_niah(args.backend, model_dir, args.tasks, args.lengths, args.samples, args.seed, args.max_tokens,
                          engine_options, chat_template=args.chat_template)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(result["scores"], args.lengths))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
