"""The default real model (SmolLM2-135M-Instruct, float32) against transformers in float64, the CLI, and a needle."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jax_offload import LLM, SamplingParams
from jax_offload.default_model import ensure_default_model
from jax_offload.eval.ruler import make_samples, score_string_match_all

# "Write a haiku about the sea." too until the suite needed the time (the host tier's tests; last passed at a1ffcf2),
# and "Explain in two sentences why the sky is blue." (last passed at 0cf451f): each prompt runs the same path.
PROMPTS = [
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def models():
    model_dir = ensure_default_model(quiet=True)
    # The reference in float64: PyTorch's float32 CPU kernels differ by machine. On CI's machine of 2026-11-27 its
    # float32 logits were 4.8e-3 from ours and 2-4e-4 from float64 where the printed ones of ours were within 1e-5; on
    # the next machine both float32 runs were within 1e-4 of float64 (bench/results/suite_time.md).
    torch_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, use_safetensors=True).eval()
    return model_dir, torch_model, LLM(model_dir, dtype="float32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_and_greedy_tokens_match_transformers(models, prompt):
    _, torch_model, llm = models
    ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
    with torch.no_grad():
        ref_logits = torch_model(torch.tensor([ids])).logits[0].numpy()
        # An explicit mask: the chat template's <|im_end|> is also the pad id, which generate would mask out.
        ref_tokens = torch_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
    assert np.abs(llm.logits(ids) - ref_logits).max() <= 1e-3
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == ref_tokens


def test_cli_answers_paris_with_speed_and_keeps_its_programs(tmp_path):
    """The CLI answers, and keeps its compiled programs: a second run loads every one of them (compiles nothing
    new into the cache) and answers the same."""
    cache = tmp_path / "xla"
    argv = [sys.executable, "-m", "jax_offload.generate", "--prompt", "What is the capital of France?",
            "--compilation-cache-dir", str(cache)]
    answers, entries = [], []
    for _ in range(2):
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "Paris" in run.stdout
        assert "tokens/s" in run.stdout
        answers.append(run.stdout.split("\n[prefill")[0])
        entries.append(sorted(p.name for p in cache.glob("*-cache")))
    assert entries[0] and entries[1] == entries[0], entries
    assert answers[1] == answers[0]


def test_offloaded_engine_finds_needles(models):
    model_dir, _, llm = models
    # 512-token prompts in 256-token blocks: two chunks, the second attending to the first streamed from the host
    # (1K prompts in 512-token blocks until the suite needed the time; last passed at 0cf451f). max_num_seqs: the
    # samples (a chunk step carries a decode row per sequence the engine may run).
    offload = LLM(model_dir, dtype="float32", offload=True, block_size=256, num_ring_slots=2, prefill="chunked",
                  max_num_seqs=2)
    samples = make_samples("niah_single_1", llm.tokenizer, 512, 2, seed=0)
    outs = offload.generate([s.prompt_ids for s in samples], SamplingParams(temperature=0.0, max_tokens=16))
    assert score_string_match_all([o.text for o in outs], [s.answers for s in samples]) == 100.0
