"""What the sparse policies' selections cost on RULER NIAH, against oracles that choose by the true attention.

A reference engine in device memory runs the real model: the whole prompt and its KV cache on the GPU, every
attention in float32 over the model's q, k, v (weights in `--dtype`), greedy decoding. Each rule below only
decides which keys a query attends; everything else is the same arithmetic, so two configs differ by their
selections alone:

  prefill  full        every causally visible key
           xattnT      XAttention's blocks at threshold T: the library's antidiagonal estimate and
                       `pallas_kernels.select_blocks` (the engine's stride and blocks), as the engine chooses them
           xoracleT    the same `select_blocks` rule on the true softmax mass of each (query block, key block):
                       the fewest blocks that hold T of each query block's attention: what an exact estimate would choose
  decode   full        every key
           questN      Quest's pages, budget N tokens per KV head: `jax_offload.sparse.quest` over the pages of
                       eval_sparse.py's stored blocks, the tail past them attended in full, the engine's pages and
                       dense layers: the engine's rule
           qoracleN    the same number of pages of the same candidates, chosen by their true softmax mass summed
                       over the GQA group (`quest.top_pages`): the most mass any choice of N tokens keeps
           sketch4bN   the engine's sketch policy (`jax_offload.sparse.sketch`): every stored key quantized to int4
                       with a per-token scale, each query head's softmax of q . k_hat over the stored keys summed
                       over the GQA group and the page; pages chosen as qoracleN chooses (same budget)
           sketch4rN   sketch4bN's pages read exactly, and every stored page it leaves out estimated: each query
                       head also attends one key per such page, with the page's estimated log-mass (the log-sum-exp
                       of its sketch logits) as its logit and the mean of its values as its value
           +denseL     with a decode rule: the first L layers dense (instead of the engine's `dense_layers`)

A config is `full`, one rule, or a prefill and a decode rule joined by `+` (`xattn0.9+quest1024`). Per length and
prefill rule the prompt is prefilled once and every decode rule of that prefill decodes from it in one batch.
Files are those of `bench/eval_sparse.py` (`sparse_niah_{length}_{config}.json`, the same prompts for the same
`--samples`, `--seed` and model), so `python bench/eval_sparse.py --report DIR --out DIR` tabulates them.

    python bench/eval_oracle.py --model DIR --lengths 4096,8192 --samples 10 \\
        --configs full,quest512,qoracle512,quest1024,qoracle1024,xattn0.9,xoracle0.9 --out DIR

Rules studied and dropped, their results in bench/results/runs/ (h200_oracle_variants, h200_oracle_fine,
h100_sketch_oracle, h100_sketch_residual), in this file at commit 4c54d28: qsumN and qheadN (Quest's bound summed
over the GQA group, or per query head), qfineN (over 8-token half pages), sketch8bN (int8 keys), sketch4cN (int4
codes per channel within each page's bounds), qmeanN (qoracleN's pages, the others estimated from their true mass).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_sparse  # noqa: E402  (also puts the repository root on sys.path)
from eval_sparse import CHUNK, causal_attention, causal_chunks, softmax_over  # noqa: E402

from jax_offload.config import PAGE_POLICY_DEFAULTS, XATTN_DEFAULTS  # noqa: E402
from jax_offload.eval.ruler import NiahSample  # noqa: E402

# The engine's Quest setting in bench/eval_sparse.py: its store blocks, and the engine's pages and dense layers.
STORE_BLOCK = eval_sparse.BASE_OPTIONS["block_size"]
PAGE_SIZE, DENSE_LAYERS = PAGE_POLICY_DEFAULTS["page_size"], PAGE_POLICY_DEFAULTS["dense_layers"]
XATTN_BLOCK, XATTN_STRIDE = XATTN_DEFAULTS["xattn_block"], XATTN_DEFAULTS["xattn_stride"]
PREFILL_KINDS = ("xattn", "xoracle")
# decode rule -> the file's decode_policy
POLICY_NAMES = {"quest": "quest", "qoracle": "quest_oracle", "sketch4b": "sketch_int4",
                "sketch4r": "sketch_int4_residual"}
ESTIMATING = "sketch4r"  # the rule that also attends an estimate of each page it leaves out


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    prefill: tuple[str, float] | None  # (kind, threshold) or None for full
    decode: tuple[str, int, int] | None  # (kind, budget in tokens, dense layers) or None for full


def parse_config(name: str) -> Config:
    """A config name -> its prefill and decode rules; a bad name is one ValueError listing what is allowed."""
    prefill = decode = dense = None
    for part in ([] if name == "full" else name.split("+")):
        match = re.fullmatch(r"([a-z]+(?:4[br])?)([0-9.]+)", part)
        kind = match[1] if match else None
        if kind in PREFILL_KINDS and prefill is None:
            threshold = float(match[2])
            if not 0.0 < threshold <= 1.0:
                raise ValueError(f"Config {name!r}: threshold {threshold} is not in (0, 1].")
            prefill = (kind, threshold)
        elif kind in POLICY_NAMES and decode is None:
            budget = int(match[2])
            if budget < 2 * PAGE_SIZE or budget % PAGE_SIZE:
                raise ValueError(f"Config {name!r}: budget {budget} must be a multiple of {PAGE_SIZE}, at least "
                                 f"{2 * PAGE_SIZE}.")
            decode = (kind, budget, DENSE_LAYERS)
        elif kind == "dense" and dense is None and match[2].isdigit():
            dense = int(match[2])
        else:
            raise ValueError(f"Config {name!r}: part {part!r} is not one of xattnT, xoracleT (prefill) or questN, "
                             "qoracleN, sketch4bN, sketch4rN (decode) with an optional denseL, at most one of each, joined by "
                             "'+'; or 'full'.")
    if dense is not None:
        if decode is None:
            raise ValueError(f"Config {name!r}: denseL needs a decode rule (questN or qoracleN).")
        decode = (decode[0], decode[1], dense)
    return Config(name, prefill, decode)


def _options(config: Config, dtype: str) -> dict[str, Any]:
    """The file's `options`: eval_sparse's report orders and plots by these keys."""
    options: dict[str, Any] = {"engine": "reference (eval_oracle.py): KV in device memory, float32 attention",
                               "dtype": dtype}
    if config.prefill:
        options |= {"prefill_rule": config.prefill[0], "xattn_threshold": config.prefill[1],
                    "xattn_stride": XATTN_STRIDE, "xattn_block": XATTN_BLOCK}
    if config.decode:
        options |= {"decode_policy": POLICY_NAMES[config.decode[0]],
                    "decode_budget": config.decode[1], "page_size": PAGE_SIZE, "dense_layers": config.decode[2],
                    "block_size": STORE_BLOCK}
    return options


# ---- attention under a mask -----------------------------------------------------------------------------------


def _attend_with_estimate(s, allowed, v, est_lse, est_v):
    """Softmax attention of scores s [R, Hkv, G, T] over the allowed keys of v [R, T, Hkv, D], joined by one
    estimated key per left-out page: logit est_lse [R, Hkv, G, P] (-inf: no such key) and value est_v [R, Hkv, P,
    D] -> float32 [R, Hkv, G, D]; every row has an allowed key."""
    import jax
    import jax.numpy as jnp

    hp = jax.lax.Precision.HIGHEST
    m = jnp.maximum(jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1), jnp.max(est_lse, axis=-1))[..., None]
    e = jnp.where(allowed, jnp.exp(s - m), 0.0)
    w = jnp.exp(est_lse - m)
    num = (jnp.einsum("rngt,rtnd->rngd", e, v.astype(jnp.float32), precision=hp)
           + jnp.einsum("rngp,rnpd->rngd", w, est_v, precision=hp))
    return num / (jnp.sum(e, axis=-1) + jnp.sum(w, axis=-1))[..., None]


def _tiles_allowed(block_mask, num_kv_heads: int):
    """`causal_attention`'s narrowing: each query head attends only in the XATTN_BLOCK x XATTN_BLOCK tiles
    `block_mask` [Hq, nqb, nkb] allows."""
    import jax
    import jax.numpy as jnp

    def allow(allowed, rows_at):
        t = allowed.shape[-1]
        tiles = jax.lax.dynamic_slice_in_dim(block_mask, rows_at[0] // XATTN_BLOCK, CHUNK // XATTN_BLOCK, axis=1)
        tiles = jnp.repeat(jnp.repeat(tiles, XATTN_BLOCK, axis=1), XATTN_BLOCK, axis=2)[..., :t]  # [Hq, C, T]
        return allowed & tiles.reshape(num_kv_heads, -1, CHUNK, t)
    return allow


def _true_block_mass(q, k, length):
    """Per query head the true causal softmax mass of every (query block, key block) tile, summed over the query
    block's real rows (< length) -> float32 [Hq, nqb, nkb], each real row contributing 1 in all."""
    t, hq = q.shape[:2]
    nb = t // XATTN_BLOCK

    def rows(s, allowed, rows_at):
        p = softmax_over(s, allowed & (rows_at[:, None] < length))
        return p.reshape(hq, CHUNK // XATTN_BLOCK, XATTN_BLOCK, nb, XATTN_BLOCK).sum((2, 4))

    per_chunk = causal_chunks(q, k, length, rows)  # [chunks, Hq, C / block, nkb]
    return per_chunk.transpose(1, 0, 2, 3).reshape(hq, nb, nb)


@functools.cache
def _prefill_layer_fn():
    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from jax_offload.models import decoder
    from jax_offload.sparse import xattention

    @functools.partial(jax.jit, static_argnums=(0, 5, 6))
    def prefill_layer(cfg, layer, x, length, inv_freq, rule, impl):
        """One layer over the padded prompt x [1, T, hidden] -> (output, k, v [T, Hkv, D], block counts [2])."""
        positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
        q, k, v = decoder.attention_inputs(cfg, layer, x, positions, inv_freq)
        nb = x.shape[1] // XATTN_BLOCK
        visible = xattention.visible_blocks(nb, nb, 0, length, XATTN_BLOCK)
        if rule is None:
            allow = None
            counts = jnp.stack([jnp.sum(visible), jnp.sum(visible)]).astype(jnp.int32) * cfg.num_heads
        else:
            kind, threshold = rule
            if kind == "xattn":
                policy = xattention.XAttention(threshold=threshold, stride=XATTN_STRIDE, block=XATTN_BLOCK)
                full_mask = xattention.select(policy, impl, q, k, q_offset=0, kv_len=length)
            else:
                sums = _true_block_mass(q[0], k[0], length)
                full_mask = pallas_kernels.select_blocks(sums[None], threshold=threshold,
                                                         block_size=XATTN_BLOCK) & visible
            counts = xattention.block_counts(full_mask, 0, length, XATTN_BLOCK)
            allow = _tiles_allowed(full_mask[0], cfg.num_kv_heads)
        o = causal_attention(q[0], k[0], v[0], length, allow)
        return decoder.attention_output_and_mlp(cfg, layer, x, o[None].astype(x.dtype)), k[0], v[0], counts

    return prefill_layer


# ---- decode ---------------------------------------------------------------------------------------------------


@functools.cache
def _decode_step_fn():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_offload.models import decoder
    from jax_offload.sparse import quest, sketch

    @functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
    def decode_step(cfg, rules, params, k_cache, v_cache, layers, tokens, position, inv_freq):
        """One greedy step for every row (row r decodes under rules[r]): tokens [R] at `position`, caches
        [L, R, Tmax, Hkv, D] -> (next tokens [R], caches, the pages each row's rule chose [L, R, Hkv, K]: K the
        largest rule's budget in pages, missing entries and rows without a rule -1)."""
        rows, t = len(rules), k_cache.shape[2]
        most_pages = max([rule[1] // PAGE_SIZE for rule in rules if rule] or [1])
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        keys = jnp.arange(t)
        visible = keys <= position
        stored = position // STORE_BLOCK * STORE_BLOCK
        tail = (keys >= stored) & visible
        hp = jax.lax.Precision.HIGHEST

        def layer_fn(x, xs):
            index, layer, kc, vc = xs
            q, k, v = decoder.attention_inputs(cfg, layer, x, jnp.full((rows, 1), position, jnp.int32), inv_freq)
            kc = jax.lax.dynamic_update_slice_in_dim(kc, k, position, axis=1)
            vc = jax.lax.dynamic_update_slice_in_dim(vc, v, position, axis=1)
            qg = q[:, 0].reshape(rows, hkv, hq // hkv, d)
            s = jnp.einsum("rngd,rtnd->rngt", qg.astype(jnp.float32), kc.astype(jnp.float32),
                           precision=hp) / math.sqrt(d)
            p_full = softmax_over(s, visible)
            num_pages_all = t // PAGE_SIZE
            masks, estimates, chosen_pages = [], [], []
            no_estimate = jnp.full((hkv, hq // hkv, num_pages_all), -jnp.inf)
            for r, rule in enumerate(rules):
                if rule is None:
                    masks.append(jnp.broadcast_to(visible, (hkv, t)))
                    estimates.append(no_estimate)
                    chosen_pages.append(jnp.full((hkv, most_pages), -1, jnp.int32))
                    continue
                kind, budget, dense = rule
                num_pages = stored // PAGE_SIZE
                if kind == "quest":
                    score = quest.page_scores(q[r, 0], *quest.page_bounds(kc[r], PAGE_SIZE))
                elif kind == "qoracle":
                    score = p_full[r].sum(1).reshape(hkv, t // PAGE_SIZE, PAGE_SIZE).sum(-1)
                else:  # the sketch: int4 keys with a scale per token
                    codes, scale = sketch.quantize_keys(kc[r].transpose(1, 0, 2), "int4")
                    page_lse = sketch.page_lse(sketch.token_scores(qg[r], sketch.pack_codes(codes, "int4"), scale,
                                                                   "int4"), PAGE_SIZE)
                    score = sketch.mass_of_pages(page_lse, num_pages)
                chosen = quest.top_pages(score, num_pages, budget // PAGE_SIZE)
                listed = jnp.where(chosen < num_pages, chosen, -1)
                chosen_pages.append(jnp.pad(listed, ((0, 0), (0, most_pages - listed.shape[1])), constant_values=-1))
                picked = jnp.zeros((hkv, t // PAGE_SIZE + 1), bool).at[jnp.arange(hkv)[:, None], chosen].set(True)
                sparse = (picked[:, keys // PAGE_SIZE] & (keys < stored)) | tail
                masks.append(jnp.where(index < dense, visible, sparse))
                if kind == ESTIMATING:
                    left_out = (~picked[:, :num_pages_all] & (jnp.arange(num_pages_all) < num_pages)
                                & (index >= dense))[:, None]
                    estimates.append(jnp.where(left_out, page_lse, -jnp.inf))
                else:
                    estimates.append(no_estimate)
            allowed = jnp.stack(masks)[:, :, None]  # [R, Hkv, 1, T]
            o = jnp.einsum("rngt,rtnd->rngd", softmax_over(s, allowed), vc.astype(jnp.float32), precision=hp)
            estimating = np.array([bool(rule) and rule[0] == ESTIMATING for rule in rules])
            if estimating.any():  # the other rows keep the plain softmax's arithmetic, bit for bit
                page_values = vc.astype(jnp.float32).reshape(rows, num_pages_all, PAGE_SIZE, hkv, d).mean(2)
                o_est = _attend_with_estimate(s, allowed, vc, jnp.stack(estimates), page_values.transpose(0, 2, 1, 3))
                o = jnp.where(estimating[:, None, None, None], o_est, o)
            x = decoder.attention_output_and_mlp(cfg, layer, x, o.reshape(rows, 1, hq, d).astype(x.dtype))
            return x, (kc, vc, jnp.stack(chosen_pages))

        x = decoder.embed(params, tokens[:, None])
        x, (k_cache, v_cache, chosen) = jax.lax.scan(layer_fn, x,
                                                     (jnp.arange(len(k_cache)), layers, k_cache, v_cache))
        tokens = jnp.argmax(decoder.logits(cfg, params, x[:, 0]), axis=-1).astype(jnp.int32)
        return tokens, k_cache, v_cache, chosen

    return decode_step


# ---- one prompt -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Model:
    cfg: Any
    params: Any
    layers: Any  # the layers' parameters stacked on a leading axis, for the decode step's scan
    inv_freq: Any
    tokenizer: Any
    eos: frozenset[int]
    impl: str


def run_prompt(model: Model, prompt: NiahSample, prefill_rule, decode_rules: tuple, max_tokens: int,
               cache_len: int, chosen: list | None = None) -> tuple[list[list[int]], list[float]]:
    """Prefill once under `prefill_rule`, then decode every rule of `decode_rules` greedily from it, one batch
    row each -> (per rule the generated ids, cut before the first EOS; the prefill density per layer). `chosen`
    (a list) gets each decode step's chosen pages, NumPy [L, R, Hkv, K] (see the decode step)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_offload.models import decoder

    n = prompt.length
    x = decoder.embed(model.params, jnp.asarray([prompt.prompt_ids + [0] * (cache_len - n)], jnp.int32))
    layer_fn, length = _prefill_layer_fn(), jnp.int32(n)
    ks, vs, density = [], [], []
    for layer in model.params.layers:
        x, k, v, counts = layer_fn(model.cfg, layer, x, length, model.inv_freq, prefill_rule, model.impl)
        ks.append(k)
        vs.append(v)
        selected, visible = np.asarray(counts)
        density.append(float(selected / visible))
    first = jnp.argmax(decoder.logits(model.cfg, model.params, x[0, n - 1]), axis=-1).astype(jnp.int32)
    rows = len(decode_rules)
    k_cache = jnp.broadcast_to(jnp.stack(ks)[:, None], (len(ks), rows, *ks[0].shape))
    v_cache = jnp.broadcast_to(jnp.stack(vs)[:, None], (len(vs), rows, *vs[0].shape))
    tokens = jnp.broadcast_to(first, (rows,))
    out = [tokens]
    step = _decode_step_fn()
    for i in range(max_tokens - 1):
        tokens, k_cache, v_cache, pages = step(model.cfg, decode_rules, model.params, k_cache, v_cache,
                                               model.layers, tokens, np.int32(n + i), model.inv_freq)
        out.append(tokens)
        if chosen is not None:
            chosen.append(np.asarray(pages))
    generated = np.asarray(jnp.stack(out, axis=1)).tolist()
    cut = [next((j for j, t in enumerate(ids) if t in model.eos), len(ids)) for ids in generated]
    return [ids[:c] for ids, c in zip(generated, cut)], density


def load_model(model_dir: Path, dtype: str) -> Model:
    import jax
    import jax.numpy as jnp

    from jax_offload import LLM
    from jax_offload.models.rope import inverse_frequencies

    llm = LLM(model_dir, dtype=dtype)  # the engine's parameters, tokenizer and EOS ids
    cfg, params = llm.model_config, llm.params
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *params.layers)
    return Model(cfg, params, layers, jnp.asarray(inverse_frequencies(cfg.rope, cfg.head_dim)), llm.tokenizer,
                 llm.eos_token_ids, "pallas" if jax.default_backend() == "gpu" else "xla")


def evaluate(args: argparse.Namespace, model_dir: Path, dtype: str) -> None:
    """Runs every config over every length's prompts; one file per (length, config), as eval_sparse writes."""
    from tqdm import tqdm

    configs = [parse_config(name) for name in args.configs]
    model = load_model(model_dir, dtype)
    base = {"max_model_len": model.cfg.max_position_embeddings}
    targets = {n: eval_sparse.prompt_target(model_dir, base, n, args.max_tokens) for n in args.lengths}
    prompts = eval_sparse.build_prompts(model_dir, targets, args.samples, args.seed)
    meta = eval_sparse.metadata()
    args.out.mkdir(parents=True, exist_ok=True)
    by_prefill: dict[Any, list[Config]] = {}
    for c in configs:
        by_prefill.setdefault(c.prefill, []).append(c)
    for n, ps in prompts.items():
        cache_len = -(-(targets[n] + args.max_tokens) // CHUNK) * CHUNK
        for prefill_rule, group in by_prefill.items():
            start = time.perf_counter()
            decode_rules = tuple(c.decode for c in group)
            records: list[list[dict[str, Any]]] = [[] for _ in group]
            for p in tqdm(ps, desc=f"{prefill_rule or 'full'} prefill @ {n}", unit="prompt", leave=False):
                outputs, density = run_prompt(model, p, prefill_rule, decode_rules, args.max_tokens, cache_len)
                for rs, ids in zip(records, outputs):
                    rs.append(eval_sparse.prompt_record(p, model.tokenizer.decode(ids, skip_special_tokens=True), ids,
                                                        prefill_density=density if prefill_rule else None))
            wall = round(time.perf_counter() - start, 2)
            for c, rs in zip(group, records):
                result = eval_sparse.write_niah_result(args, c.name, _options(c, dtype), n, targets[n], model_dir, ps,
                                                       rs, meta, wall_seconds_of_prefill_group=wall)
                print(f"{c.name} @ {n} (prompts <= {targets[n]} tokens): mean score {result['mean_score']:.1f} "
                      f"({', '.join(f'{s:.0f}' for s in result['scores'].values())}), group {wall:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = eval_sparse.run_parser(__doc__, parse_config, "full,quest512,qoracle512,quest1024,qoracle1024").parse_args(argv)
    try:
        if args.samples < 1 or args.max_tokens < 2:
            raise ValueError("--samples must be at least 1 and --max-tokens at least 2.")
        evaluate(args, *eval_sparse.model_and_dtype(args))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
