"""The engine with the Pallas kernels (interpret mode on the CPU), end to end, against its jnp path."""
from __future__ import annotations

import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams

MODEL_SEED, PROMPT_SEED = 301, 302


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_models.build_in(tmp_path_factory, "llama3", MODEL_SEED)


def test_pallas_engine_matches_jnp_engine(model_dir):
    ids = np.random.default_rng(PROMPT_SEED).integers(3, tiny_models.VOCAB, size=37).tolist()
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}"
    in_gpu = {impl: LLM(model_dir, dtype="float32", attention_impl=impl) for impl in ("pallas", "xla")}
    reference = in_gpu["xla"].logits(ids)
    assert np.abs(in_gpu["pallas"].logits(ids) - reference).max() <= 1e-5, where

    offload = LLM(model_dir, dtype="float32", attention_impl="pallas", offload=True, block_size=16, num_ring_slots=2)
    assert np.abs(offload.logits(ids) - reference).max() <= 1e-5, where
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # crosses a block boundary at 48
    assert offload.generate([ids], greedy)[0].token_ids == in_gpu["xla"].generate([ids], greedy)[0].token_ids, where


def test_pallas_batch_engine_matches_jnp_one_at_a_time(model_dir):
    """Several prompts batched with the Pallas kernels (packed prefill, paged decode) give the jnp engine's greedy
    tokens one request at a time."""
    rng = np.random.default_rng(PROMPT_SEED + 1)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (37, 5, 21)]
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED + 1}"
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    batched = LLM(model_dir, dtype="float32", attention_impl="pallas", max_num_seqs=4).generate(prompts, greedy)
    reference = LLM(model_dir, dtype="float32", attention_impl="xla")
    for prompt, out in zip(prompts, batched):
        assert out.token_ids == reference.generate([prompt], greedy)[0].token_ids, where


def test_one_prompt_runs_on_the_batch_engine(model_dir):
    """With the Pallas kernels, one prompt decodes on the batch engine (one compiled step for the whole model) with
    the per-request path's greedy tokens, a prompt longer than a prefill step (140 tokens, budget 128) after a
    prefill in two chunks, the second through the Pallas kernels over the first's keys in the pool; with a short
    prompt beside it, each chunk's step also decodes the short one's next token."""
    rng = np.random.default_rng(PROMPT_SEED + 2)
    short, long = (rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (29, 140))
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED + 2}"
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    reference = LLM(model_dir, dtype="float32", attention_impl="xla")
    llm = LLM(model_dir, dtype="float32", attention_impl="pallas", max_num_seqs=2, max_num_batched_tokens=128)
    want = [reference.generate(p, greedy)[0].token_ids for p in (short, long)]
    assert llm.generate(long, greedy)[0].token_ids == want[1], where
    engine = llm._batch_engine
    assert engine is not None and [kind for kind, *_ in list(engine.step_log)[:2]] == ["chunk", "chunk"], where
    assert llm.generate(short, greedy)[0].token_ids == want[0], where
    assert engine.step_log[0][:2] == ("prefill", 1), "one short prompt skipped the batch engine"
    # Together: the short prompt decodes in the steps of the long one's chunks (one program a layer for both).
    assert [o.token_ids for o in llm.generate([short, long], greedy)] == want, where
    assert [n for kind, n, *_ in engine.step_log if kind == "chunk"] == [2, 2], where
