"""bfloat16, the dtype users run: the offloaded engine must still give what the in-GPU engine gives.

Attention states stay float32 from the kernels through every merge and are rounded once per layer, and
every step rounds exactly where the program says (no excess precision), so only float32 rounding
noise separates the two engines.

This is the CPU twins' check: blocks of 16 and 64 tokens stream every prompt here. On a GPU the same holds in the
default batch-invariant mode with blocks that are multiples of the decode split (512 to 4,096 keys by max_model_len;
docs/exactness.md, "How bfloat16 stays exact"; shown on the 8B shape and the real model:
bench/results/runs/h100_one_answer/); run there with these blocks, all four cases part from in-GPU memory's greedy
tokens (H100, 2026-11-27, without the mode then: bench/results/runs/h100_gpu_tests/README.md).
"""
from __future__ import annotations

import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams

MODEL_SEEDS = {"llama3": 9101, "qwen2": 9102, "qwen3": 9103}
PROMPT_SEED = 9200
NUM_PROMPTS = 6  # 10 until the suite needed the time (commit 36091a7)
# 64 new tokens cross blocks of 16 and 64 tokens during decode for every prompt (120 in earlier sessions; the
# suite's time budget).
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
# Every pair of (block size, ring slots, prefill) values meets in one of these four (all eight combinations
# passed when this test ran them all, commit 63fba59; four keep the suite fast).
CONFIGS = [(16, 1, "chunked"), (16, 3, "layerwise"), (64, 1, "layerwise"), (64, 3, "chunked")]
# Each model runs two of them, both block sizes and both prefill modes, and every config runs on some model (all
# four on every model until the suite needed the time; last passed at 0cf451f, and qwen3 with the first and third
# until 07ab582): the offloaded engine rounds where the in-GPU engine does through the same model code whatever the
# model. Tiny Qwen3's bfloat16 tokens offloaded equal in-GPU memory's in tests/test_batch_invariance.py.
CASES = [("llama3", *CONFIGS[0]), ("llama3", *CONFIGS[2]), ("qwen2", *CONFIGS[1]), ("qwen2", *CONFIGS[3])]
# max |logit difference| offloaded vs in-GPU over these prompts and all eight configs, measured with the
# engine before partial states stayed float32 and excess precision was turned off (commit ad70287, this
# file run there): the bar is a quarter of it. Greedy outputs then matched on 0 to 5 of the 10 prompts.
BEFORE = {"llama3": 0.0625, "qwen2": 0.046875, "qwen3": 0.0546875}


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The in-GPU logits and greedy tokens of the variant the test names (built once per variant)."""
    variant, seed = request.param, MODEL_SEEDS[request.param]
    path = tmp_path_factory.mktemp(variant)
    tiny_models.build(variant, path, seed=seed)
    rng = np.random.default_rng(PROMPT_SEED)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=int(n)).tolist() for n in rng.integers(5, 130, NUM_PROMPTS)]
    in_gpu = LLM(path, dtype="bfloat16")
    logits = [in_gpu.logits(p) for p in prompts]
    # One at a time: several prompts at once run the batch engine, checked in tests/test_batch_invariance.py.
    tokens = [in_gpu.generate([p], GREEDY_64)[0].token_ids for p in prompts]
    return variant, seed, path, prompts, logits, tokens


@pytest.mark.parametrize("reference,block_size,num_ring_slots,prefill", CASES, indirect=["reference"])
def test_bf16_offload_equals_in_gpu(reference, block_size, num_ring_slots, prefill, record_property):
    variant, seed, path, prompts, logits, tokens = reference
    offload = LLM(path, dtype="bfloat16", offload=True, block_size=block_size, num_ring_slots=num_ring_slots,
                  prefill=prefill)
    max_diff = max(float(np.abs(offload.logits(p) - ref).max()) for p, ref in zip(prompts, logits))
    record_property("max_abs_logit_diff", max_diff)
    print(f"\n{variant} (seed {seed}) block {block_size} slots {num_ring_slots} {prefill}: max |dlogit| {max_diff}")
    # One at a time, as the reference (the batch engine's bits: tests/test_batch_invariance.py).
    outs = [offload.generate([p], GREEDY_64)[0] for p in prompts]
    same = [o.token_ids == ref for o, ref in zip(outs, tokens)]
    assert all(same), f"{variant} model seed {seed}, prompt seed {PROMPT_SEED}: greedy differs on prompts {same}"
    assert max_diff <= BEFORE[variant] / 4, f"{variant} model seed {seed}: max |dlogit| {max_diff}"


# ---- offloaded requests together give each its bits alone (issue 63) ------------------------------------------
TOGETHER_SEEDS = {"llama3": 9111, "qwen3": 9113}
# Prompts of varied lengths over blocks of 256 tokens: several blocks streamed, tails crossing into a new block
# during decode (230, 500, 760), and prompts within one block.
TOGETHER_LENGTHS = [7, 230, 300, 500, 90, 760]
# Greedy, with the drawn tokens' log-probabilities: compared bit for bit, they show any bit of a row's hidden state
# that changed with the batch, where greedy tokens agree as long as no near-tie flips.
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=list(TOGETHER_SEEDS))
def tiny_bf16(request, tmp_path_factory):
    variant = request.param
    return variant, tiny_models.build_in(tmp_path_factory, variant, TOGETHER_SEEDS[variant])


def test_bf16_offloaded_together_equals_each_alone(tiny_bf16):
    """Offloaded prompts given together (the batch engine: their tails attended and their layers multiplied in one
    call per layer) draw the tokens and log-probabilities, bit for bit, that each draws offloaded alone (the
    per-request path). The jnp attention twin and XLA's CPU matmuls used to change a row's bits with the batch size
    (tests/test_batch_invariance.py): here Qwen3's first prompt drew other log-probabilities (Llama's agreed), and
    the issue's models parted in greedy tokens on 1 of 6 prompts (Llama) and 2 of 6 (Qwen3) (issue 63)."""
    variant, path = tiny_bf16
    seed = TOGETHER_SEEDS[variant]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in TOGETHER_LENGTHS]
    # max_num_seqs 8: a tail pool of 8 slots, not the default's 256 (a step took ~90 ms over that pool on the CPU,
    # ~10 ms over 8). The store holds every prompt at once, so all six decode together.
    llm = LLM(path, dtype="bfloat16", offload=True, block_size=256, max_model_len=4096, max_num_seqs=8)
    alone = [llm.generate([p], GREEDY_LOGPROBS)[0] for p in prompts]
    together = llm.generate(prompts, GREEDY_LOGPROBS)
    where = f"{variant} model seed {seed}, prompt seed {seed}"
    assert [o.token_ids for o in together] == [o.token_ids for o in alone], where
    for i, (t, a) in enumerate(zip(together, alone)):
        assert [x.logprob for x in t.logprobs] == [x.logprob for x in a.logprobs], f"{where}: prompt {i}, log-probs"
