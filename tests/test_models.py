"""Our Flax decoder against transformers' PyTorch models: logits and greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models
from jax_offload import LLM, SamplingParams

CASES = [  # (variant, shard size, seed of the weights and prompts)
    ("llama3", None, 101),
    ("llama_tied", None, 102),
    ("qwen2", None, 103),
    ("qwen2", "40KB", 104),  # sharded checkpoint with model.safetensors.index.json
    ("qwen3", None, 105),
    ("qwen3_tied", None, 106),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{v}{'-sharded' if s else ''}" for v, s, _ in CASES])
def model_pair(request, tmp_path_factory):
    variant, shard, seed = request.param
    out = tmp_path_factory.mktemp(variant)
    torch_model = tiny_models.build(variant, out, seed=seed, max_shard_size=shard)
    # max_num_seqs 2, the greedy test's prompts: with the default 256 the CPU pool holds 8192 blocks of 256 tokens,
    # and a batched generate of tiny llama_tied took 5 s over it (0.03 s over 64 blocks).
    return torch_model, LLM(out, dtype="float32", max_num_seqs=2), seed


def test_logits_match_transformers(model_pair):
    torch_model, llm, seed = model_pair
    rng = np.random.default_rng(seed)
    for length in (1, 7, 40, 100):
        ids = rng.integers(3, tiny_models.VOCAB, size=length).tolist()
        ours = llm.logits(ids)
        with torch.no_grad():
            ref = torch_model(torch.tensor([ids])).logits[0].numpy()
        assert ours.shape == ref.shape == (length, tiny_models.VOCAB)
        assert np.abs(ours - ref).max() <= 1e-4, f"seed {seed}, length {length}"


def test_greedy_generation_matches_transformers(model_pair):
    torch_model, llm, seed = model_pair
    rng = np.random.default_rng(seed + 1)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (5, 23)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2
            )[0, len(ids):].tolist()
        assert out.token_ids == ref, f"seed {seed}, prompt length {len(ids)}"
