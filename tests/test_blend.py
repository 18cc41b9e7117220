"""CacheBlend (`Segments` prompts, `jax_offload.blend`): the token choice against float64 NumPy, the segment store's
LRU, and the engine (tiny Llama, float32): recomputing every token is full prefill, a reused true prefix is
exact, reuse is counted and really happens, and the options' errors."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams, Segments
from jax_offload.blend import SegmentKV, SegmentStore, choose_recompute
from jax_offload.models import decoder


def test_choose_recompute_matches_float64():
    seed = 9400
    rng = np.random.default_rng(seed)
    t, hkv, d = 40, 2, 8
    fresh, kept = rng.standard_normal((2, t, hkv, d)).astype(np.float32)
    kept[5] = fresh[5]  # no deviation at all
    reused = np.ones(t, bool)
    reused[-10:] = False
    always = np.zeros(t, bool)
    always[-10:-4] = True  # the question; the last 4 rows are padding
    for count in (0, 1, 7, 30, 34):
        got = np.asarray(choose_recompute(jnp.asarray(fresh), jnp.asarray(kept), jnp.asarray(reused),
                                          jnp.asarray(always), jnp.int32(count)))
        deviation = ((fresh.astype(np.float64) - kept) ** 2).sum((1, 2))
        order = sorted(np.flatnonzero(reused), key=lambda i: (-deviation[i], i))
        want = always.copy()
        want[order[:count]] = True
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, count {count}")


def test_segment_store_drops_the_least_recently_used():
    def kv(n):
        return SegmentKV([jnp.zeros((1, n, 1, 4), jnp.float32)], [jnp.zeros((1, n, 1, 4), jnp.float32)], n)

    store = SegmentStore(capacity_bytes=3 * 32 * 10)  # three 10-token segments (32 bytes a token)
    for key in "abc":
        store.put(key, kv(10))
    assert store.get("a") is not None  # a is now the most recent: b goes first
    store.put("d", kv(10))
    assert store.get("b") is None and all(store.get(k) is not None for k in "acd")
    store.put("huge", kv(40))  # larger than the whole store: not kept, nothing dropped for it
    assert store.get("huge") is None and len(store) == 3 and store.bytes_held == 3 * 320


MODEL_SEED, PROMPT_SEED = 9401, 9402
OPTIONS = dict(dtype="float32", max_model_len=256, enable_prefix_caching=True, prefix_cache_host_gb=0.01)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
WHERE = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = tiny_models.build_in(tmp_path_factory, "llama3", MODEL_SEED)
    rng = np.random.default_rng(PROMPT_SEED)
    system, doc_a, doc_b, question = (rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (20, 50, 37, 9))
    return path, system, doc_a, doc_b, question


def _last_logits(llm: LLM, segments: list[list[int]]) -> np.ndarray:
    hidden, *_ = llm._blend_runner().prefill(segments, sum(map(len, segments)) + 1)
    return np.asarray(decoder.logits(llm.model_config, llm.params, hidden))[0, 0]


def test_ratio_one_is_full_prefill_and_reuse_is_counted(parts):
    path, system, doc_a, doc_b, question = parts
    llm = LLM(path, blend_recompute_ratio=1.0, **OPTIONS)
    order = [system, doc_a, doc_b, question]  # the documents in the other order: test_cli_segments_lines
    ids = [t for part in order for t in part]
    diff = np.abs(_last_logits(llm, order) - llm.logits(ids)[-1]).max()
    assert diff <= 1e-5, f"{WHERE}: max |dlogit| {diff}"
    out = llm.generate(Segments(order), GREEDY)[0]
    assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids, WHERE
    assert out.num_cached_tokens == len(ids) - len(question), WHERE  # every segment kept by the call before


def test_reuse_places_kept_segments_exactly(parts):
    """Ratio 0 reuses every kept segment: a system prompt computed alone is exactly what the full prompt holds
    there (a true prefix), so the logits are full prefill's; a document after it lacks its attention to the
    system prompt, so they are not."""
    path, system, doc_a, _, question = parts
    llm = LLM(path, blend_recompute_ratio=0.0, **OPTIONS)
    diff = np.abs(_last_logits(llm, [system, question]) - llm.logits(system + question)[-1]).max()
    assert diff <= 1e-5, f"{WHERE}: max |dlogit| {diff}"
    reused = np.abs(_last_logits(llm, [system, doc_a, question]) - llm.logits(system + doc_a + question)[-1]).max()
    assert reused > 1e-3, f"{WHERE}: the reused document changed nothing ({reused})"


@pytest.mark.parametrize("options,message", [
    (dict(dtype="float32"), "enable_prefix_caching=True and prefix_cache_host_gb > 0"),
    (dict(OPTIONS, blend_recompute_ratio=1.5), r"blend_recompute_ratio must be a number in \[0, 1\]"),
])
def test_bad_blend_options(parts, options, message):
    path, system, _, _, question = parts
    with pytest.raises(ValueError, match=message):
        LLM(path, **options).generate(Segments([system, question]), GREEDY)


def test_cli_segments_lines(parts, tmp_path, capsys):
    """`--prompt-file` lines with "segments": the second, its documents in the other order, reuses both (at ratio 1
    its tokens are full prefill's)."""
    import json

    from jax_offload import generate as generate_cli

    path, system, doc_a, doc_b, question = parts
    words = lambda ids: " ".join(tiny_models.WORDS[i - 3] for i in ids) + " "
    lines = [{"segments": [words(doc_a), words(doc_b), words(question)]},
             {"segments": [words(doc_b), words(doc_a), words(question)]}]
    prompts = tmp_path / "segments.jsonl"
    prompts.write_text("\n".join(map(json.dumps, lines)) + "\n")
    argv = ["--model", str(path), "--prompt-file", str(prompts), "--json", "--no-chat-template", "--max-tokens", "4",
            "--dtype", "float32", "--max-model-len", "256", "--enable-prefix-caching", "--prefix-cache-host-gb", "0.01",
            "--blend-recompute-ratio", "1"]
    assert generate_cli.main(argv) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["num_cached_tokens"] for o in out] == [0, len(doc_a) + len(doc_b)], WHERE
    full = LLM(path, dtype="float32", max_model_len=256).generate(
        [doc_b + doc_a + question], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out[1]["token_ids"] == full.token_ids, WHERE


def test_segments_together_equal_each_alone(parts):
    """CacheBlend prompts run on the batch engine: several at once beside a plain prompt, greedy and seeded, give
    each one's tokens alone, also when a scarce pool preempts them and they are recomputed (the blend again, then
    their generated tokens as chunks); their blended KV never serves a later plain prompt as a cached prefix."""
    from jax_offload.serving.engine import BatchEngine

    path, system, doc_a, doc_b, question = parts
    llm = LLM(path, blend_recompute_ratio=0.3, **OPTIONS)
    prompts = [Segments([system, doc_a, question]), Segments([system, doc_b, doc_a, question]),
               system + doc_b + question, Segments([doc_b, question])]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == alone, WHERE
    engine = llm._batch_engine
    assert max(n for kind, n, _, _ in engine.step_log if kind == "decode") == len(prompts), WHERE

    # 12 blocks of 16 tokens hold the four short requests' prompts (12 blocks), not their growth (19).
    short = [Segments([doc_b, question]), Segments([system, question]), system + question,
             Segments([system, doc_b, question])]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(short, params)]
    pairs = [llm._blend_prompt(p) if isinstance(p, Segments) else (p, None) for p in short]
    scarce = BatchEngine.in_gpu(llm.model_config, llm.params, llm._inv_freq, llm.dtype, llm.attention_impl,
                                llm.max_model_len, llm.tokenizer, llm.eos_token_ids, block_size=16, num_blocks=12,
                                swap_space_bytes=0, enable_prefix_caching=True)
    outs = scarce.generate([ids for ids, _ in pairs], params, own_prefills=[blend for _, blend in pairs])
    blends = sum(kind == "alone" for kind, *_ in scarce.step_log)
    assert [o.token_ids for o in outs] == alone and blends > 3, f"{WHERE}, {scarce.stats}, {blends} blend steps"
    plain = scarce.generate([short[2]], GREEDY)[0]  # ran plain before: its full blocks are cached
    blended = scarce.generate([pairs[0][0]], GREEDY)[0]  # ran only blended: none of its blocks may be
    assert plain.num_cached_tokens > 0 and blended.num_cached_tokens == 0, WHERE
