"""Sparse attention policies on RULER NIAH with a real model: scores per task, agreement with full attention
output for output, XAttention prefill density per layer, and the share of full-attention probability mass
that Quest's chosen pages hold.

    python bench/eval_sparse.py --model DIR --lengths 4096,8192 --samples 10 \\
        --configs full,quest512,quest1024,xattn0.8,xattn0.9,xattn0.95,xattn0.9+quest1024 --out DIR
    python bench/eval_sparse.py --model DIR --lengths 4096,8192 --samples 10 --configs quest512,quest1024 \\
        --mass --out DIR
    python bench/eval_sparse.py --report DIR --out bench/results

Every config is one `LLM` over the same base, `offload=True, block_size=256, num_ring_slots=2,
prefill="chunked"` (`--base key=value,...` overrides or adds base options; `--dtype` defaults to bfloat16 on a
GPU, float32 otherwise), and runs every length's prompts greedily for `--max-tokens` tokens. A config name is
`full` or parts joined by `+`: `questN` and `sketchN` (Quest or sketch decode, budget N tokens per KV head, the
engine's pages and dense layers) and `xattnT` (XAttention prefill at threshold T, the engine's stride and blocks).
Each length's prompts (the eight RULER NIAH tasks, `--samples` each, `--seed`) are built once, so every config sees
the same token ids;
prompts are fitted to at most `min(length, max_model_len - max_tokens)` tokens, so that all tokens can be
generated. A run writes `sparse_niah_{length}_{config}.json` per length and config under `--out` (`+` written as `-`).
`--together N` passes the prompts to `generate` N at a time, so that the batch engine runs them together (continuous
batching; N at once needs `max_num_seqs` >= N and a host store for all N, `--base host_kv_tokens=...`); each file
records N as `together`.

`--reference DIR` names an earlier run's folder (another engine, placement or machine, the same prompts): each line
printed and each file (`reference`) then say how many outputs have that run's token ids, config for config.

`--mass` generates nothing: for each length and each Quest budget among `--configs` it runs the model layer by
layer in device memory (float32 attention) and measures, per layer and query head, the share of the
full-attention probability mass of the last prompt token's query that Quest's pages (chosen per KV head among
the stored blocks' keys, as the engine chooses them) plus the tail (the keys past the last full block, always
attended) hold; the first `dense_layers` layers attend in full (share 1). Next to it, the share an oracle's pages
hold: per KV head as many pages of the same candidates (page 0 included), chosen by their true softmax mass summed
over the GQA group's query heads, the most group mass any such choice holds; Quest's gap to the oracle is what its
bound loses, the oracle's gap to 1 what the budget cannot reach. It writes `quest_mass_{length}.json`.
(The engine's first Quest step reads with the first generated token's query, one position later; the last
prompt token's query stands in for it, so no generation is needed.)

`--report DIR --out OUT` reads those files (or NAME.json.gz) and writes `OUT/sparse_niah.md` with the plots
`sparse_niah.png` and `niah_by_task.png`.
"""
from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import read_json, result_files, run_metadata  # noqa: E402  (also puts the repository root on sys.path)

from jax_offload.config import PAGE_POLICY_DEFAULTS, SKETCH_DEFAULTS, XATTN_DEFAULTS  # noqa: E402
from jax_offload.eval.niah import positive_int_list  # noqa: E402
from jax_offload.eval.ruler import TASKS, NiahSample, make_samples, score_string_match_all  # noqa: E402

BASE_OPTIONS: dict[str, Any] = {"offload": True, "block_size": 256, "num_ring_slots": 2, "prefill": "chunked"}
# The engine's defaults, written into every result file's options (the report and the mass pass read them there).
PAGE_OPTIONS = {k: PAGE_POLICY_DEFAULTS[k] for k in ("page_size", "dense_layers")}
XATTN_OPTIONS = {k: XATTN_DEFAULTS[k] for k in ("xattn_stride", "xattn_block")}
# The parts a config name is made of: prefix -> (how its number is read, the LLM options it adds).
PARTS: dict[str, tuple[Callable[[str], Any], Callable[[Any], dict[str, Any]]]] = {
    "quest": (int, lambda budget: {"decode_policy": "quest", "decode_budget": budget, **PAGE_OPTIONS}),
    "sketch": (int, lambda budget: {"decode_policy": "sketch", "decode_budget": budget, **PAGE_OPTIONS,
                                    **SKETCH_DEFAULTS}),
    "xattn": (float, lambda threshold: {"prefill_policy": "xattention", "xattn_threshold": threshold,
                                        **XATTN_OPTIONS}),
}
NIAH_FILE, MASS_FILE = "sparse_niah_{length}_{config}.json", "quest_mass_{length}.json"
CHUNK = 512  # query rows per float32 attention step (here and in eval_oracle.py): scores are [heads, 512, T]


# ---- configs ------------------------------------------------------------------------------------------------


def config_options(name: str) -> dict[str, Any]:
    """The LLM options a config name adds to the base: {} for `full`, else the union of its `+`-joined parts."""
    if name == "full":
        return {}
    options: dict[str, Any] = {}
    for part in name.split("+"):
        match = re.fullmatch(r"([a-z]+)([0-9.]+)", part)
        if match is None or match[1] not in PARTS:
            raise ValueError(f"Config {name!r} is not full or questN / sketchN / xattnT parts joined by '+'.")
        read, options_of = PARTS[match[1]]
        try:
            value = read(match[2])
        except ValueError:
            raise ValueError(f"Config {name!r}: {match[2]!r} is not a valid {read.__name__} for {match[1]}.") from None
        added = options_of(value)
        if set(added) & set(options):
            raise ValueError(f"Config {name!r} sets {match[1]} twice.")
        options |= added
    return options


def config_list(check: Callable[[str], Any]) -> Callable[[str], list[str]]:
    """The --configs type: comma-separated names, each passed to `check`, whose ValueError is argparse's error."""
    def names_of(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError("--configs must name at least one config")
        try:
            for name in names:
                check(name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return names
    return names_of


def _base_options(text: str) -> dict[str, Any]:
    """`key=value,...` -> options, each value read by `_literal`."""
    out: dict[str, Any] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--base item {item!r} is not key=value")
        out[key.strip()] = _literal(raw.strip())
    return out


def _together(text: str) -> int:
    """The --together type: an integer >= 1."""
    if re.fullmatch(r"[0-9]+", text.strip()) is None or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--together must be an integer >= 1, got {text!r}")
    return int(text)


def _literal(raw: str) -> Any:
    """A --base value: true / false, none, an int, a float, or else the string itself."""
    try:
        return json.loads({"true": "true", "false": "false", "none": "null"}.get(raw.lower(), raw))
    except json.JSONDecodeError:
        return raw


# ---- prompts and run metadata -------------------------------------------------------------------------------


def prompt_target(model_dir: Path, base: dict[str, Any], length: int, max_tokens: int) -> int:
    """The most prompt tokens at `length` that still leave room for `max_tokens` under max_model_len."""
    from jax_offload.config import ModelConfig

    max_len = base.get("max_model_len") or ModelConfig.from_hf(model_dir).max_position_embeddings
    target = min(length, max_len - max_tokens)
    if target < 1:
        raise ValueError(f"max_model_len {max_len} leaves no room for a prompt and {max_tokens} new tokens.")
    return target


def build_prompts(model_dir: Path, targets: dict[int, int], samples: int, seed: int) -> dict[int, list[NiahSample]]:
    """Per length, the eight NIAH tasks' prompts (`samples` each), at most `targets[length]` tokens long."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return {n: [s for task in TASKS for s in make_samples(task, tokenizer, target, samples, seed)]
            for n, target in targets.items()}


def prompts_digest(prompts: list[NiahSample]) -> str:
    """sha256 of the prompts' (task, index, token ids): equal digests mean the very same prompts."""
    text = json.dumps([[p.task, p.index, p.prompt_ids] for p in prompts])
    return hashlib.sha256(text.encode()).hexdigest()


def metadata() -> dict[str, Any]:
    """`run_metadata` (date, device, versions, command line, commit) with the backend and jaxlib's version."""
    import jax
    import jaxlib

    return run_metadata() | {"backend": jax.default_backend(), "jaxlib": jaxlib.__version__}


# ---- NIAH runs ----------------------------------------------------------------------------------------------


def run_prompts(llm: Any, prompts: list[NiahSample], max_tokens: int, desc: str,
                together: int) -> list[dict[str, Any]]:
    """Greedy generation for every prompt, `together` consecutive prompts per `generate` call; one record per
    prompt with its output, score and densities."""
    from tqdm import tqdm

    from jax_offload import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    records = []
    with tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False) as bar:
        for start in range(0, len(prompts), together):
            group = prompts[start:start + together]
            for p, out in zip(group, llm.generate([q.prompt_ids for q in group], sampling)):
                density = out.prefill_density
                records.append(prompt_record(
                    p, out.text, out.token_ids, finish_reason=out.finish_reason,
                    prefill_seconds=round(out.prefill_seconds, 4), decode_seconds=round(out.decode_seconds, 4),
                    prefill_density=None if density is None else [float(d) for d in density]))
            bar.update(len(group))
    return records


def prompt_record(p: NiahSample, text: str, ids: list[int], **extra: Any) -> dict[str, Any]:
    """A result file's record of one prompt: the prompt, the output, its RULER score, then `extra`."""
    return {"task": p.task, "index": p.index, "prompt_tokens": p.length, "depths": p.depths, "expected": p.answers,
            "output": text, "output_token_ids": list(ids), "score": score_string_match_all([text], [p.answers]),
            **extra}


def task_scores(records: list[dict[str, Any]]) -> dict[str, float]:
    """RULER string_match_all per task, in TASKS order."""
    return {t: score_string_match_all([r["output"] for r in rs], [r["expected"] for r in rs])
            for t in TASKS if (rs := [r for r in records if r["task"] == t])}


def write_niah_result(args: argparse.Namespace, config: str, options: dict[str, Any], n: int, target: int,
                      model_dir: Path, prompts: list[NiahSample], records: list[dict[str, Any]],
                      meta: dict[str, Any], together: int = 1, **timing: float) -> dict[str, Any]:
    """Writes one (length, config)'s result file under args.out, as both engines write it; returns its content.
    `together`: the prompts per `generate` call."""
    scores = task_scores(records)
    result = {
        "kind": "sparse_niah", "config": config, "options": options, "length": n, "prompt_target": target,
        "model": str(model_dir), "samples": args.samples, "seed": args.seed, "max_tokens": args.max_tokens,
        "together": together, "prompts_sha256": prompts_digest(prompts), "scores": scores,
        "mean_score": sum(scores.values()) / len(scores), "records": records, **timing, "meta": meta,
    }
    # "+" is kept out of file names: some copy tools refuse it.
    name = NIAH_FILE.format(length=n, config=config.replace("+", "-"))
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    return result


def same_outputs(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompts whose output token ids equal the reference's, prompts both have), matched by (task, index)."""
    ref = {(r["task"], r["index"]): r["output_token_ids"] for r in reference}
    pairs = [(r["output_token_ids"], ref[(r["task"], r["index"])]) for r in records if (r["task"], r["index"]) in ref]
    return sum(a == b for a, b in pairs), len(pairs)


def reference_records(folder: Path, n: int, config: str, prompts: list[NiahSample]) -> tuple[str, list[dict[str, Any]]]:
    """(file, records) of the same config's earlier run on the same prompts in `folder` (another engine, placement or
    machine): what `--reference` compares outputs with."""
    name = NIAH_FILE.format(length=n, config=config.replace("+", "-"))
    files = result_files(folder, name)
    if not files:
        raise FileNotFoundError(f"No reference {name} (or .gz) in {folder}.")
    reference = read_json(files[0])
    if reference["prompts_sha256"] != prompts_digest(prompts):
        raise ValueError(f"The reference {files[0]} ran other prompts (prompts_sha256 {reference['prompts_sha256']}).")
    return str(files[0]), reference["records"]


def evaluate(args: argparse.Namespace, model_dir: Path, base: dict[str, Any]) -> None:
    """Runs every config over every length's prompts, writing one JSON file per (length, config)."""
    from jax_offload import LLM

    options = {name: base | config_options(name) for name in args.configs}
    targets = {n: prompt_target(model_dir, base, n, args.max_tokens) for n in args.lengths}
    prompts = build_prompts(model_dir, targets, args.samples, args.seed)
    # Read before any run, so that a missing or mismatched reference stops nothing halfway.
    references = {} if args.reference is None else {
        (n, name): reference_records(args.reference, n, name, prompts[n])
        for n in args.lengths for name in args.configs}
    meta = metadata()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[int, str], dict[str, Any]] = {}
    for name in args.configs:
        start = time.perf_counter()
        try:
            llm = LLM(model_dir, **options[name])
        except TypeError as err:
            raise ValueError(f"LLM rejected the options of config {name!r} ({err}).") from None
        except ValueError as err:
            raise ValueError(f"Config {name!r}: {err}") from None
        load_s = time.perf_counter() - start
        for n in args.lengths:
            start = time.perf_counter()
            records = run_prompts(llm, prompts[n], args.max_tokens, f"{name} @ {n}", args.together)
            wall_s = round(time.perf_counter() - start, 2)
            extra = {}
            if references:
                file, reference = references[(n, name)]
                same, total = same_outputs(records, reference)
                extra["reference"] = {"file": file, "same": same, "total": total}
            result = write_niah_result(args, name, options[name], n, targets[n], model_dir, prompts[n], records, meta,
                                       together=args.together, load_seconds=round(load_s, 2), wall_seconds=wall_s,
                                       **extra)
            results[(n, name)] = result
            agree = ""
            if (n, "full") in results and name != "full":
                same, total = same_outputs(records, results[(n, "full")]["records"])
                agree = f", same ids as full {same}/{total}"
            if extra:
                agree += f", same ids as the reference {extra['reference']['same']}/{extra['reference']['total']}"
            together = f", {args.together} per generate call" if args.together > 1 else ""
            print(f"{name} @ {n} (prompts <= {targets[n]} tokens{together}): mean score "
                  f"{result['mean_score']:.1f}{agree}, {result['wall_seconds']:.0f} s (+{load_s:.0f} s load)",
                  flush=True)
        del llm
        gc.collect()


# ---- Quest attention mass -----------------------------------------------------------------------------------


def softmax_over(s, allowed):
    """Softmax of float32 scores s [..., T] over the allowed keys; a row with nothing allowed is all 0 (padding
    rows: never NaN, which would reach real rows through a later layer's p @ v)."""
    import jax.numpy as jnp

    m = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(allowed, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def causal_chunks(q, k, length, rows_fn: Callable):
    """Causal float32 scores of q [T, Hq, D] over k [T, Hkv, D] (query head h reads KV head h // (Hq / Hkv)),
    CHUNK query rows at a time: rows_fn(s [Hkv, G, CHUNK, T], allowed [CHUNK, T] (causal, keys < length), the
    chunk's row positions [CHUNK]) per chunk -> its results stacked over the chunks."""
    import jax
    import jax.numpy as jnp

    t, hq, d = q.shape
    hkv = k.shape[1]
    qs = q.astype(jnp.float32).reshape(t // CHUNK, CHUNK, hkv, hq // hkv, d) / math.sqrt(d)
    k, keys = k.astype(jnp.float32), jnp.arange(t)

    def rows(args):
        qc, first = args
        s = jnp.einsum("cngd,tnd->ngct", qc, k, precision=jax.lax.Precision.HIGHEST)
        rows_at = first + jnp.arange(CHUNK)
        return rows_fn(s, (keys <= rows_at[:, None]) & (keys < length), rows_at)

    return jax.lax.map(rows, (qs, jnp.arange(0, t, CHUNK)))


def causal_attention(q, k, v, length, allow: Callable | None = None):
    """Causal softmax attention in float32 of q [T, Hq, D] over k, v [T, Hkv, D] (keys < length) -> [T, Hq, D];
    `allow(allowed [CHUNK, T], rows_at)` -> [Hkv, G, CHUNK, T] narrows the keys each query head attends."""
    import jax
    import jax.numpy as jnp

    t, hq, d = q.shape
    v = v.astype(jnp.float32)

    def rows(s, allowed, rows_at):
        allowed = allowed if allow is None else allow(allowed, rows_at)
        return jnp.einsum("ngct,tnd->cngd", softmax_over(s, allowed), v, precision=jax.lax.Precision.HIGHEST)

    return causal_chunks(q, k, length, rows).reshape(t, hq, d)


def _quest_shares(q, k, length, block_size: int, page_size: int, budgets_pages: tuple[int, ...]):
    """For the query q [Hq, D] at position length - 1 over keys k [T, Hkv, D] (the first `length` real): per
    budget and query head, the full-softmax mass on the pages Quest chooses among the stored blocks' keys plus
    the tail past them, and the same for the oracle's pages -> float32 [2 (Quest, oracle), len(budgets), Hq].

    The oracle ranks the same candidates by their true mass summed over the GQA group (one choice per KV head,
    as Quest's): no choice of as many pages holds more of the group's mass (a single query head may hold less
    than on Quest's pages), so the gap to Quest is what Quest's bound loses and the oracle's own shortfall is
    attention spread beyond the budget."""
    import jax
    import jax.numpy as jnp

    from jax_offload.sparse.quest import page_bounds, select_pages, top_pages

    t, hkv, d = k.shape
    hq = q.shape[0]
    keys = jnp.arange(t)
    s = jnp.einsum("ngd,tnd->ngt", q.astype(jnp.float32).reshape(hkv, hq // hkv, d), k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
    p = jax.nn.softmax(jnp.where(keys < length, s, -jnp.inf), axis=-1)  # [Hkv, G, T]
    stored = length // block_size * block_size
    kmin, kmax = page_bounds(k, page_size)  # [Hkv, T / page_size, D]
    slots = max(t // page_size, *budgets_pages)  # top_k needs at least `budget` candidates
    pad = ((0, 0), (0, slots - kmin.shape[1]), (0, 0))
    kmin, kmax = jnp.pad(kmin, pad), jnp.pad(kmax, pad)
    group_mass = jnp.pad(p.sum(1).reshape(hkv, t // page_size, page_size).sum(-1), pad[:2])  # [Hkv, slots]
    tail = (keys >= stored) & (keys < length)

    def share(chosen):  # chosen [Hkv, budget] pages, `slots` = none -> [Hq] mass on them plus the tail
        picked = jnp.zeros((hkv, slots + 1), bool).at[jnp.arange(hkv)[:, None], chosen].set(True)
        attended = (picked[:, keys // page_size] & (keys < stored)) | tail  # [Hkv, T]
        return jnp.sum(jnp.where(attended[:, None], p, 0.0), axis=-1).reshape(hq)

    num_pages = stored // page_size
    return jnp.stack([jnp.stack([share(select_pages(q, kmin, kmax, num_pages, b)) for b in budgets_pages]),
                      jnp.stack([share(top_pages(group_mass, num_pages, b)) for b in budgets_pages])])


@functools.cache
def _mass_layer_fn() -> Callable:
    """The jitted layer of the mass pass: (cfg, layer, x [1, T, hidden], prompt length, inv_freq, block_size,
    page_size, budgets in pages) -> (the layer's output, `_quest_shares` of its last prompt query)."""
    import jax
    import jax.numpy as jnp

    from jax_offload.models import decoder
    from jax_offload.precision import step_jit

    @functools.partial(step_jit, static_argnums=(0, 5, 6, 7))
    def layer_step(cfg, layer, x, length, inv_freq, block_size, page_size, budgets_pages):
        positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
        q, k, v = decoder.attention_inputs(cfg, layer, x, positions, inv_freq)
        o = causal_attention(q[0], k[0], v[0], length)
        shares = _quest_shares(jax.lax.dynamic_index_in_dim(q[0], length - 1, keepdims=False), k[0], length,
                               block_size, page_size, budgets_pages)
        return decoder.attention_output_and_mlp(cfg, layer, x, o[None]), shares

    return layer_step


def prompt_shares(cfg: Any, params: Any, inv_freq: Any, ids: list[int], block_size: int, page_size: int,
                  budgets: tuple[int, ...], dense_layers: int) -> Any:
    """One prompt through every layer -> np.float32 [layers, 2 (Quest, oracle), len(budgets), Hq] mass shares
    (1 for the first `dense_layers` layers)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_offload.models import decoder

    padded = -(-len(ids) // math.lcm(CHUNK, page_size)) * math.lcm(CHUNK, page_size)
    x = decoder.embed(params, jnp.asarray([ids + [0] * (padded - len(ids))], jnp.int32))
    step, length = _mass_layer_fn(), jnp.int32(len(ids))
    budgets_pages = tuple(b // page_size for b in budgets)
    out = []
    for l, layer in enumerate(params.layers):
        x, shares = step(cfg, layer, x, length, inv_freq, block_size, page_size, budgets_pages)
        out.append(np.ones_like(shares) if l < dense_layers else np.asarray(shares))
    return np.stack(out)


def _share_stats(shares: Any, prefix: str = "") -> dict[str, Any]:
    """Shares [P, L, Hq] -> per layer the mean and 5th percentile over (prompts x query heads), and the shares."""
    import numpy as np

    flat = shares.transpose(1, 0, 2).reshape(shares.shape[1], -1)  # [L, P * Hq]
    return {f"{prefix}mean": flat.mean(1).round(6).tolist(),
            f"{prefix}p5": np.percentile(flat, 5, axis=1).round(6).tolist(),
            f"{prefix}shares": shares.round(5).tolist()}


def measure_mass(args: argparse.Namespace, model_dir: Path, base: dict[str, Any], dtype: str) -> None:
    """Writes quest_mass_{length}.json for every length: per layer the mean and 5th percentile over
    (prompts x query heads) of the mass share of every Quest budget among the configs, Quest's (`mean`, `p5`,
    `shares`) and the oracle's (the same keys prefixed `oracle_`)."""
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from convert.safetensors_loader import load_params
    from jax_offload.config import ModelConfig
    from jax_offload.models.rope import inverse_frequencies
    from jax_offload.tensor_parallel import TensorParallel

    quest = {}
    for name in args.configs:
        options = config_options(name)
        if options.get("decode_policy") == "quest":
            quest[options["decode_budget"]] = options
    if not quest:
        raise ValueError("--mass needs at least one questN config in --configs.")
    page_sizes, dense = {o["page_size"] for o in quest.values()}, {o["dense_layers"] for o in quest.values()}
    if len(page_sizes) > 1 or len(dense) > 1:
        raise ValueError("--mass needs every Quest config to share one page_size and one dense_layers.")
    (page_size,), (dense_layers,) = page_sizes, dense
    budgets = tuple(sorted(quest))
    block_size = (base | quest[budgets[0]]).get("block_size")
    if not isinstance(block_size, int) or block_size % page_size:
        raise ValueError(f"--mass needs an integer block_size that page_size {page_size} divides, got {block_size!r}.")
    cfg = ModelConfig.from_hf(model_dir)
    params = load_params(model_dir, cfg, jnp.dtype(dtype), TensorParallel.create(1))
    inv_freq = jnp.asarray(inverse_frequencies(cfg.rope, cfg.head_dim))
    targets = {n: prompt_target(model_dir, base, n, args.max_tokens) for n in args.lengths}
    prompts = build_prompts(model_dir, targets, args.samples, args.seed)
    meta = metadata()
    args.out.mkdir(parents=True, exist_ok=True)
    for n, ps in prompts.items():
        start = time.perf_counter()
        shares = np.stack([prompt_shares(cfg, params, inv_freq, p.prompt_ids, block_size, page_size, budgets,
                                         dense_layers)
                           for p in tqdm(ps, desc=f"mass @ {n}", unit="prompt", leave=False)])  # [P, L, 2, B, Hq]
        per_budget = {str(b): _share_stats(shares[:, :, 0, i]) | _share_stats(shares[:, :, 1, i], "oracle_")
                      for i, b in enumerate(budgets)}
        result = {
            "kind": "quest_mass", "length": n, "prompt_target": targets[n], "model": str(model_dir), "dtype": dtype,
            "samples": args.samples, "seed": args.seed, "prompts_sha256": prompts_digest(ps),
            "block_size": block_size, "page_size": page_size, "dense_layers": dense_layers,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "query": "last prompt token (position T-1), full softmax over keys 0..T-1, attention in float32",
            "oracle": "per KV head as many pages as Quest (page 0 included, the same candidates), those with the "
                      "highest softmax mass summed over the GQA group's query heads",
            "prompts": [{"task": p.task, "index": p.index, "prompt_tokens": p.length} for p in ps],
            "budgets": per_budget, "wall_seconds": round(time.perf_counter() - start, 2), "meta": meta,
        }
        (args.out / MASS_FILE.format(length=n)).write_text(json.dumps(result) + "\n")
        means = ", ".join(f"budget {b}: {np.mean(per_budget[str(b)]['mean'][dense_layers:]):.3f} "
                          f"(oracle {np.mean(per_budget[str(b)]['oracle_mean'][dense_layers:]):.3f})" for b in budgets)
        print(f"mass @ {n} ({len(ps)} prompts <= {targets[n]} tokens): mean share over sparse layers {means}, "
              f"{result['wall_seconds']:.0f} s", flush=True)


# ---- report -------------------------------------------------------------------------------------------------


def _config_order(result: dict[str, Any]) -> tuple:
    """full, then Quest by budget, XAttention by threshold, then combinations."""
    o = result["options"]
    quest, xattn = o.get("decode_policy") in ("quest", "sketch"), "xattn_threshold" in o
    rank = 3 if quest and xattn else 2 if xattn else 1 if quest else 0
    return rank, o.get("xattn_threshold", 0.0), o.get("decode_budget", 0), result["config"]


def load_results(src: Path) -> tuple[dict[int, list[dict[str, Any]]], dict[int, dict[str, Any]]]:
    """-> ({length: NIAH results in config order}, {length: Quest mass result}) of the files in `src`."""
    niah: dict[int, list[dict[str, Any]]] = {}
    for path in result_files(src, "sparse_niah_*.json"):
        result = read_json(path)
        niah.setdefault(result["length"], []).append(result)
    for n, results in niah.items():
        results.sort(key=_config_order)
        digests = {r["prompts_sha256"] for r in results}
        if len(digests) > 1:
            raise ValueError(f"The {n}-token files in {src} were run on different prompts (another --samples, "
                             "--seed, tokenizer or max_model_len); put one run's files in a directory.")
    mass = {r["length"]: r for r in map(read_json, result_files(src, "quest_mass_*.json"))}
    if not niah and not mass:
        raise FileNotFoundError(f"No sparse_niah_*.json or quest_mass_*.json files in {src}.")
    return dict(sorted(niah.items())), dict(sorted(mass.items()))


def _niah_section(n: int, results: list[dict[str, Any]]) -> list[str]:
    names = [r["config"] for r in results]
    full = next((r for r in results if r["config"] == "full"), None)
    samples = {r["samples"] for r in results}
    lines = [f"## {n} tokens", "",
             f"Prompts of at most {results[0]['prompt_target']} tokens, {'/'.join(map(str, sorted(samples)))} per "
             "task; string_match_all score (prompts).", "",
             "| task | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for task in TASKS:
        if any(task in r["scores"] for r in results):
            cells = [f"{r['scores'][task]:.1f} ({sum(x['task'] == task for x in r['records'])})"
                     if task in r["scores"] else "-" for r in results]
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines.append("| **mean** | " + " | ".join(f"{r['mean_score']:.1f}" for r in results) + " |")
    others = [r for r in results if r["config"] != "full"]
    if full is not None and others:
        lines += ["", "Difference to full (score points); the last row counts prompts whose output token ids equal "
                  "full's.", "", "| task | " + " | ".join(r["config"] for r in others) + " |",
                  "|---|" + "---:|" * len(others)]
        diffs = {r["config"]: {t: r["scores"][t] - full["scores"][t] for t in r["scores"] if t in full["scores"]}
                 for r in others}
        for task in (t for t in TASKS if t in full["scores"]):
            lines.append(f"| {task} | " + " | ".join(
                f"{diffs[r['config']][task]:+.1f}" if task in diffs[r["config"]] else "-" for r in others) + " |")
        lines.append("| **max abs** | " + " | ".join(
            f"{max(map(abs, diffs[r['config']].values()), default=0.0):.1f}" for r in others) + " |")
        agree = [same_outputs(r["records"], full["records"]) for r in others]
        lines.append("| **same ids as full** | " + " | ".join(
            f"{s}/{t} ({s / t:.2f})" if t else "-" for s, t in agree) + " |")
    dense = [r for r in results if any(x["prefill_density"] for x in r["records"])]
    if dense:
        per_layer = {r["config"]: [sum(col) / len(col) for col in zip(*(x["prefill_density"] for x in r["records"]
                                                                          if x["prefill_density"]))]
                     for r in dense}
        layers = max(len(v) for v in per_layer.values())
        lines += ["", "XAttention prefill density per layer (selected / causally visible blocks), mean over prompts.",
                  "", "| layer | " + " | ".join(per_layer) + " |", "|---|" + "---:|" * len(per_layer)]
        for l in range(layers):
            lines.append(f"| {l} | " + " | ".join(f"{v[l]:.3f}" if l < len(v) else "-" for v in per_layer.values())
                         + " |")
        lines.append("| **mean** | " + " | ".join(f"{sum(v) / len(v):.3f}" for v in per_layer.values()) + " |")
    return lines + [""]


def _mass_section(n: int, m: dict[str, Any]) -> list[str]:
    """The mass table: per layer and budget, Quest's share and, where the file has it, the oracle's."""
    budgets = list(m["budgets"])
    oracle = all("oracle_mean" in m["budgets"][b] for b in budgets)  # files from before the oracle lack it
    kinds = [("Quest", ""), ("oracle", "oracle_")] if oracle else [("Quest", "")]
    columns = [(b, name, prefix) for b in budgets for name, prefix in kinds]
    lines = [f"## Quest attention mass, {n} tokens", "",
             f"Share of the full-attention probability mass on Quest's pages plus the tail (block {m['block_size']}, "
             f"page {m['page_size']}, the first {m['dense_layers']} layers dense), query of the last prompt token; "
             f"mean and 5th percentile over {len(m['prompts'])} prompts x {m['num_heads']} query heads, "
             f"{m['dtype']} weights, float32 attention."]
    if oracle:
        lines[-1] += (" Oracle: per KV head as many pages as Quest (page 0 included, the same candidate pages, the "
                      "tail attended), chosen by their true mass summed over the GQA group's query heads; no choice "
                      "of that many pages holds more of the group's mass, so Quest's gap to it is what its bound "
                      "loses, and the oracle's own shortfall is attention spread beyond the budget.")
    lines += ["", "| layer | " + " | ".join(f"{b} {name} mean | {b} {name} p5" for b, name, _ in columns) + " |",
              "|---|" + "---:|---:|" * len(columns)]
    layers = len(m["budgets"][budgets[0]]["mean"])
    for l in range(layers):
        lines.append(f"| {l} | " + " | ".join(
            f"{m['budgets'][b][prefix + 'mean'][l]:.4f} | {m['budgets'][b][prefix + 'p5'][l]:.4f}"
            for b, _, prefix in columns) + " |")
    sparse = slice(m["dense_layers"], layers)
    lines.append("| **sparse layers** | " + " | ".join(
        f"{sum(m['budgets'][b][prefix + 'mean'][sparse]) / max(layers - m['dense_layers'], 1):.4f} | "
        f"{min(m['budgets'][b][prefix + 'p5'][sparse], default=1.0):.4f} (min)" for b, _, prefix in columns) + " |")
    return lines + [""]


def _provenance(files: list[dict[str, Any]]) -> list[str]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        runs.setdefault(f["meta"]["command"], []).append(f["meta"])
    lines = ["## Provenance", ""]
    for command, metas in runs.items():
        dates = sorted(m["date"] for m in metas)
        keys = ("device", "backend", "jax", "jaxlib", "transformers", "python", "git")
        versions = "; ".join(f"{k} {', '.join(sorted({str(m.get(k)) for m in metas}))}" for k in keys)
        lines += [f"- `{command}`", f"  ({len(metas)} files, {dates[0]}"
                  + (f" to {dates[-1]}" if dates[-1] != dates[0] else "") + f"; {versions})"]
    return lines + [""]


def report(src: Path, out: Path) -> None:
    """Writes OUT/sparse_niah.md (tables) and OUT/sparse_niah.png (score vs budget and vs threshold)."""
    niah, mass = load_results(src)
    model = next(iter(niah.values()))[0]["model"] if niah else next(iter(mass.values()))["model"]
    files = [r for rs in niah.values() for r in rs] + list(mass.values())
    lines = ["# Sparse attention on RULER NIAH", "", f"Model `{Path(model).name}`; source files in `{src}`. "
             "Configs: full = the base engine (options below), no sparsity; questN = Quest decode with an N-token budget per KV head; "
             "xattnT = XAttention prefill at threshold T; qoracleN and xoracleT (`bench/eval_oracle.py`'s reference engine) "
             "choose as many pages, or blocks up to the same threshold, by the true attention mass.", ""]
    for n, results in niah.items():
        base = dict(results[0]["options"])  # what every config at this length shares
        for r in results[1:]:
            base = {k: v for k, v in base.items() if r["options"].get(k) == v}
        lines += [f"Base engine options at {n} tokens: `{base}`", ""] + _niah_section(n, results)
    for n, m in mass.items():
        lines += _mass_section(n, m)
    if niah:
        lines += ["`sparse_niah.png`: mean score against the Quest budget (questN configs) and against the XAttention "
                  "threshold (xattnT configs), one line per length; dotted: the oracles; dashed: full. "
                  "`niah_by_task.png`: each config's score per task.", ""]
    lines += _provenance(files) + [f"This report: `python {shlex.join(sys.argv)}`.", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse_niah.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if niah:
        try:
            import plots
        except ImportError:
            raise ImportError("matplotlib is missing (pip install -e '.[bench]'): sparse_niah.md is written, "
                              "its plots are not.") from None
        plots.niah_by_budget(niah, out / "sparse_niah.png")
        plots.niah_by_task(niah, out / "niah_by_task.png")


# ---- command line -------------------------------------------------------------------------------------------


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def run_parser(doc: str, check_config: Callable[[str], Any], default_configs: str) -> argparse.ArgumentParser:
    """The arguments of a NIAH run, this script's and eval_oracle.py's."""
    p = _ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", type=positive_int_list, default=[4096], help="comma-separated prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=10, help="prompts per task and length")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--configs", type=config_list(check_config), default=config_list(check_config)(default_configs))
    p.add_argument("--dtype", help="the weights' dtype (default: bfloat16 on a GPU, float32 otherwise)")
    p.add_argument("--out", type=Path, required=True, help="where result files (or the report) go")
    return p


def model_and_dtype(args: argparse.Namespace) -> tuple[Path, str]:
    """--model or the default model (downloaded if missing), and --dtype or the backend's default."""
    import jax

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    if args.model is not None:
        return args.model, dtype
    from jax_offload.default_model import ensure_default_model

    return ensure_default_model(), dtype


def main(argv: list[str] | None = None) -> int:
    p = run_parser(__doc__, config_options, "full,quest512,quest1024,xattn0.8,xattn0.9,xattn0.95,xattn0.9+quest1024")
    p.add_argument("--base", type=_base_options, default={}, help="key=value,... added to or replacing the base "
                   f"engine options {BASE_OPTIONS}")
    p.add_argument("--together", type=_together, default=1, metavar="N",
                   help="prompts per generate call, run together by the batch engine (default 1: one at a time); N "
                   "at once needs max_num_seqs >= N (the engine's default 256) and host_kv_tokens for all N "
                   "requests (default max_model_len, one request's most): pass them with --base")
    p.add_argument("--reference", type=Path, metavar="DIR", help="an earlier run's folder: print and record how many "
                   "outputs equal that run's of the same config and length (its prompts must be these)")
    p.add_argument("--mass", action="store_true", help="measure Quest's attention mass instead of running NIAH")
    p.add_argument("--report", type=Path, metavar="DIR", help="write tables and a plot from the files in DIR")
    args = p.parse_args(argv)
    try:
        if args.report is not None:
            report(args.report, args.out)
            return 0
        if args.samples < 1 or args.max_tokens < 1:
            raise ValueError("--samples and --max-tokens must be at least 1.")
        model_dir, dtype = model_and_dtype(args)
        base = BASE_OPTIONS | args.base | {"dtype": dtype}
        if args.mass:
            measure_mass(args, model_dir, base, dtype)
        else:
            evaluate(args, model_dir, base)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
