"""Continuous batching (jax_offload.serving) gives what `LLM.generate` gives one request at a time: greedy and
seeded tokens do not depend on the batch a request runs in, on preemption, or on where its KV lives."""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams
from jax_offload import generate as generate_cli
from jax_offload.serving.block_manager import BlockManager
from jax_offload.serving.engine import BatchEngine, run_requests
from jax_offload.serving.model_runner import packed_length, prefill_bucket
from jax_offload.serving.scheduler import Scheduler
from jax_offload.serving.sequence import Sequence

# Tiny Qwen2 and Qwen3 (seeds 402, 403) ran here too until the suite needed the time (last at 0cf451f): the batch
# engine calls the model code the one-request path calls; Qwen3 runs batched in tests/test_batch_invariance.py, Qwen2
# and Qwen3 in tests/tp_check.py.
MODEL_SEEDS = {"llama3": 401}
PROMPT_SEED = 411
NUM_PROMPTS = 16  # 24 until the suite needed the time (2026-11-26)
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16
POOL_BLOCKS = 600  # every request fits at once: no preemption
SCARCE_BLOCKS = 30  # 1 to 3 requests at a time (the longest needs 22 blocks)


@functools.cache
def _llm(variant: str, tmp_root) -> LLM:
    path = tmp_root / variant
    tiny_models.build(variant, path, seed=MODEL_SEEDS[variant])
    return LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("batching")


def _workload(count: int = NUM_PROMPTS) -> tuple[list[list[int]], list[SamplingParams]]:
    """`count` prompts of 1..300 tokens, 1..64 new tokens each, greedy; every fourth stops at a word."""
    rng = np.random.default_rng(PROMPT_SEED)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=int(n)).tolist() for n in rng.integers(1, 301, count)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), stop="w7" if i % 4 == 3 else None)
              for i, m in enumerate(rng.integers(1, 65, count))]
    return prompts, params


def _engine(llm: LLM, **options) -> BatchEngine:
    options = {"block_size": BLOCK_SIZE, "num_blocks": POOL_BLOCKS, "max_num_batched_tokens": 2048} | options
    return BatchEngine.in_gpu(llm.model_config, llm.params, llm._inv_freq, llm.dtype, llm.attention_impl,
                              llm.max_model_len, llm.tokenizer, llm.eos_token_ids, **options)


@functools.cache
def _one_at_a_time(variant: str, tmp_root, sampling_seed: int | None = None) -> list[tuple[list[int], str]]:
    llm = _llm(variant, tmp_root)
    prompts, params = _workload() if sampling_seed is None else _sampled_workload(sampling_seed)
    outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    return [(o.token_ids, o.text) for o in outs]


def _check(outs, reference, where: str) -> None:
    got = [(o.token_ids, o.text) for o in outs]
    bad = [i for i, (g, r) in enumerate(zip(got, reference)) if g != r]
    assert not bad, f"{where}: requests {bad} differ from one-at-a-time LLM.generate"


# ---- (a) batched greedy == one at a time -------------------------------------------------------------------
# max_num_seqs from 1 (no batching) to 24 (all at once): five limits (every limit to 8 and every fourth
# after passed until the suite needed the time for prefix caching, commit 36091a7). Steps are padded to the same power-of-two batch sizes whatever the limit, so the whole sweep compiles
# each step once per model and pool.

LIMITS = (1, 3, 24)  # 2 and 8 as well until the suite needed the time (the fp8 KV tests)


# Limit 1 (the batch engine one request at a time) runs in the preemption test below, over the scarce pool, where it
# must not preempt. qwen2 at 24 too until the suite needed the time (see MODEL_SEEDS).
@pytest.mark.parametrize("variant,limits", [("llama3", LIMITS[1:])])
def test_batched_greedy_equals_one_at_a_time(tmp_root, variant, limits):
    llm = _llm(variant, tmp_root)
    prompts, params = _workload()
    reference = _one_at_a_time(variant, tmp_root)
    for max_num_seqs in limits:
        engine = _engine(llm, max_num_seqs=max_num_seqs)
        outs = engine.generate(prompts, params)
        where = f"model seed {MODEL_SEEDS[variant]}, prompt seed {PROMPT_SEED}, max_num_seqs {max_num_seqs}"
        _check(outs, reference, where)
        assert engine.stats.preemptions == 0, where
        largest = max(n for kind, n, _, _ in engine.step_log if kind == "decode")
        assert largest <= max_num_seqs and (largest > 1 or max_num_seqs == 1), where
        # Once every prompt is admitted, decode steps overlap the reading of the previous step's tokens.
        assert engine.overlapped_steps > 0 or max_num_seqs < NUM_PROMPTS, where


def test_prefill_programs_in_groups_of_layers(tmp_root, monkeypatch):
    """The prefill runs consecutive layers per program (the largest divisor of the layer count up to 8), and
    several groups give what one does: the tiny model's two layers one per program equal the one-request path."""
    from jax_offload import buckets

    assert [buckets.layer_group_size(n) for n in (2, 7, 13, 24, 28, 30, 32, 36, 80)] == [2, 7, 1, 8, 7, 6, 8, 6, 8]
    monkeypatch.setattr(buckets, "LAYER_GROUP_MAX", 1)
    llm = _llm("llama3", tmp_root)
    prompts, params = _workload()
    outs = _engine(llm).generate(prompts[:4], params[:4])
    _check(outs, _one_at_a_time("llama3", tmp_root)[:4], f"model seed {MODEL_SEEDS['llama3']}, prompt seed "
           f"{PROMPT_SEED}, a program per layer")


def test_llm_generate_batches_several_prompts(tmp_root):
    """`LLM.generate` with several prompts and the KV in GPU memory runs the batch engine (default block size,
    pool sized by gpu_memory_utilization); outputs in prompt order, streamed text equal to the outputs."""
    _llm("llama3", tmp_root)
    llm = LLM(tmp_root / "llama3", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=24)
    prompts, params = _workload()
    streamed = [""] * NUM_PROMPTS

    def on_text(i: int, delta: str) -> None:
        streamed[i] += delta

    outs = llm.generate(prompts, params, on_text, progress=True)
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}"
    _check(outs, _one_at_a_time("llama3", tmp_root), where)
    assert streamed == [o.text for o in outs], where
    engine = llm._batch_engine
    assert engine is not None and engine.stats.preemptions == 0, where
    assert max(n for kind, n, _, _ in engine.step_log if kind == "decode") > 1, where
    assert engine.overlapped_steps > 0, where  # stop strings are met while the next step is in flight


def test_cli_keeps_the_compilation_cache_its_caller_configured(tmp_path):
    """`generate.main` called from a program that configured JAX's compilation cache keeps that cache (the
    command line's default, $JAX_OFFLOAD_CACHE/xla, is for a run of its own); an explicit directory still wins."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_compilation_cache_max_size")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        generate_cli._keep_compiled_programs(None)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        generate_cli._keep_compiled_programs(str(tmp_path / "asked"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "asked")
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_cli_prompt_file_jsonl_writes_json_lines(tmp_root, tmp_path, capsys, monkeypatch):
    """`--prompt-file x.jsonl --json`: the prompts run together, one JSON line per output in prompt order, the
    tokens those of one-at-a-time greedy `LLM.generate`; the engine sized for 5 running requests, not the 24 asked
    for."""
    _llm("llama3", tmp_root)
    built = []
    load_llm = generate_cli.load_llm
    monkeypatch.setattr(generate_cli, "load_llm", lambda args, quiet: built.append(args.max_num_seqs) or load_llm(
        args, quiet))
    prompts = [p for p in _workload()[0][:5]]
    texts = [" ".join(tiny_models.WORDS[i - 3] for i in p) for p in prompts]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(t if i % 2 else {"prompt": t}) for i, t in enumerate(texts)) + "\n")
    argv = ["--model", str(tmp_root / "llama3"), "--prompt-file", str(path), "--json", "--no-chat-template",
            "--max-tokens", "6", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "24"]
    assert generate_cli.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    expected = [_llm("llama3", tmp_root).generate([p], greedy)[0].token_ids for p in prompts]
    assert [line["index"] for line in lines] == list(range(5))
    assert [line["prompt_tokens"] for line in lines] == [len(p) for p in prompts]
    assert [line["token_ids"] for line in lines] == expected, f"prompt seed {PROMPT_SEED}"
    assert built == [5]


def test_streamed_text_is_the_output_text(tmp_root):
    llm = _llm("llama3", tmp_root)
    prompts, params = _workload()
    streamed = [""] * NUM_PROMPTS

    def on_text(i: int, delta: str) -> None:
        streamed[i] += delta

    outs = _engine(llm, max_num_seqs=8).generate(prompts, params, on_text)
    assert streamed == [o.text for o in outs], f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}"
    assert any(o.finish_reason == "stop" for o in outs[3::4]), "no request met its stop string; pick another word"


# ---- (b) preemption: KV swapped to host and back, or recomputed ---------------------------------------------

def _swap_bytes(llm: LLM, blocks: int) -> int:
    cfg = llm.model_config
    return blocks * 2 * cfg.num_layers * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 4


# qwen3 at limit 8 too until the suite needed the time (last passed at 0cf451f): tests/tp_check.py swaps and
# recomputes tiny Qwen3's requests in GPU memory (TP=2). Limit 24 too (last passed at 07ab582): the recompute tests
# below preempt at 8, and limit 3 here.
@pytest.mark.parametrize("variant,limits", [("llama3", LIMITS[:2])])
def test_preemption_swaps_and_keeps_outputs(tmp_root, variant, limits):
    """A pool of 30 blocks for 16 requests: the newest running requests are preempted again and again, their KV
    swapped to host memory and back."""
    llm = _llm(variant, tmp_root)
    prompts, params = _workload()
    reference = _one_at_a_time(variant, tmp_root)
    for max_num_seqs in limits:
        engine = _engine(llm, max_num_seqs=max_num_seqs, num_blocks=SCARCE_BLOCKS,
                         swap_space_bytes=_swap_bytes(llm, 10 * SCARCE_BLOCKS))
        outs = engine.generate(prompts, params)
        stats = engine.stats
        where = f"model seed {MODEL_SEEDS[variant]}, prompt seed {PROMPT_SEED}, max_num_seqs {max_num_seqs}, {stats}"
        _check(outs, reference, where)
        assert stats.preemptions == stats.swap_outs == stats.swap_ins and stats.recomputes == 0, where
        assert (stats.preemptions > 0) == (max_num_seqs > 1), where
        assert engine.blocks.num_free == SCARCE_BLOCKS and engine.runner.host_bytes_used == 0, where


@pytest.mark.parametrize("swap_blocks", [0, 16])
def test_preemption_recomputes_when_host_room_runs_out(tmp_root, swap_blocks):
    """With no host room every preempted request is recomputed (a prefill of prompt + output so far); with room
    for a few swaps, the first preemptions swap and the later ones recompute."""
    llm = _llm("llama3", tmp_root)
    prompts, params = _workload()
    engine = _engine(llm, max_num_seqs=8, num_blocks=SCARCE_BLOCKS, swap_space_bytes=_swap_bytes(llm, swap_blocks))
    outs = engine.generate(prompts, params)
    stats = engine.stats
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, swap blocks {swap_blocks}, {stats}"
    _check(outs, _one_at_a_time("llama3", tmp_root), where)
    assert stats.preemptions == stats.swap_outs + stats.recomputes and stats.swap_ins == stats.swap_outs, where
    assert stats.recomputes > 0 and (stats.swap_outs > 0) == (swap_blocks > 0), where
    assert engine.blocks.num_free == SCARCE_BLOCKS and engine.runner.host_bytes_used == 0, where


# A budget of 64 in the pool for all (no preemption) too until the suite needed the time (last passed at 0cf451f):
# the scarce pool's run makes the same chunks, asserts the same plan, and recomputes besides.
@pytest.mark.parametrize("budget,num_blocks", [(200, SCARCE_BLOCKS)])
def test_long_prompts_prefill_in_chunks(tmp_root, budget, num_blocks):
    """With a step budget of 200 tokens, in which the largest padded row is 128 (prompts start at multiples of
    PACK_ALIGN, 128), a longer prompt runs alone, in chunks of 128 over consecutive steps, each attending to the prompt's keys already in the pool, the running
    requests decoding a token in the same steps; with a scarce pool and no host room, the recomputes of preempted
    requests (prompt and output so far) are chunked too."""
    llm = _llm("llama3", tmp_root)
    prompts, params = _workload()
    engine = _engine(llm, max_num_seqs=8, max_num_batched_tokens=budget, num_blocks=num_blocks, swap_space_bytes=0)
    outs = engine.generate(prompts, params)
    stats = engine.stats
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, budget {budget}, {stats}"
    _check(outs, _one_at_a_time("llama3", tmp_root), where)
    assert engine.scheduler.max_chunk == 128, where
    chunk_steps = [n for kind, n, _, _ in engine.step_log if kind == "chunk"]
    assert len(chunk_steps) >= sum((len(p) - 1) // 128 for p in prompts), where  # every chunk before a last one
    assert max(chunk_steps) > 1, where  # running requests decoded in a chunk's step
    assert (stats.recomputes > 0) == (num_blocks == SCARCE_BLOCKS) and stats.swap_outs == 0, where
    assert engine.blocks.num_free == num_blocks and engine.scheduler.chunking is None, where


# ---- (c) seeded sampling does not depend on the batch -----------------------------------------------------

def _sampled_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, greedy = _workload()
    # Most requests use top-p (sample_token itself); every third samples the tempered logits without filters.
    params = [SamplingParams(temperature=0.8, top_p=1.0 if i % 3 == 2 else 0.9, max_tokens=g.max_tokens,
                             seed=seed + i) for i, g in enumerate(greedy)]
    return prompts, params


SAMPLING_SEED = 1000


def test_seeded_sampling_ignores_batch_composition(tmp_root):
    llm = _llm("llama3", tmp_root)
    prompts, params = _sampled_workload(SAMPLING_SEED)
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, request seeds {SAMPLING_SEED}+i"
    # Two sets of neighbours over the scarce pool: up to 8 at a time, preempted requests swapped to host memory and
    # back; up to 3 at a time, preempted requests recomputed (no host room). max_num_seqs 1 and 3 against 24 in a
    # pool for all (no preemption) until the suite needed the time (24 last passed at 0cf451f, 3 at a1ffcf2); the
    # odd requests alone in reverse order until commit 36091a7. Each run compiles its steps per batch size and
    # kind of draw, per pool: these two share theirs.
    swapped = _engine(llm, max_num_seqs=8, num_blocks=SCARCE_BLOCKS)
    tokens = [o.token_ids for o in swapped.generate(prompts, params)]
    recomputed = _engine(llm, max_num_seqs=3, num_blocks=SCARCE_BLOCKS, swap_space_bytes=0)
    assert [o.token_ids for o in recomputed.generate(prompts, params)] == tokens, where
    assert swapped.stats.swap_outs > 0 and recomputed.stats.recomputes > 0, f"{where}: {swapped.stats}, " \
        f"{recomputed.stats}"
    # top-p requests run sample_token with LLM's keys, so they match LLM.generate one at a time too.
    reference = _one_at_a_time("llama3", tmp_root, SAMPLING_SEED)
    assert [tokens[i] for i in range(NUM_PROMPTS) if i % 3 != 2] == \
        [reference[i][0] for i in range(NUM_PROMPTS) if i % 3 != 2], where


def test_decode_steps_in_one_program_give_the_tokens_of_single_steps(tmp_root):
    """num_decode_steps=4: greedy and tempered seeded requests, three of them ending on a stop string inside a
    program's steps, beside a request asking for log-probabilities, one for top-p and one with min_tokens (their
    neighbours take single steps while they run), give the tokens and text of single steps; programs of 4 steps ran
    and no block is held after."""
    llm = _llm("llama3", tmp_root)
    prompts, _ = _workload(8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=SAMPLING_SEED + i, max_tokens=40)
              for i in range(8)]
    params[1] = dataclasses.replace(params[1], logprobs=2, max_tokens=3)
    params[3] = dataclasses.replace(params[3], top_p=0.9, max_tokens=5)
    params[5] = dataclasses.replace(params[5], min_tokens=6, max_tokens=30)
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, request seeds {SAMPLING_SEED}+i"
    single = _engine(llm, max_num_seqs=8)
    texts = [o.text for o in single.generate(prompts, params)]
    for i in (0, 2, 7):  # stop at a piece of the text some way in
        params[i] = dataclasses.replace(params[i], stop=texts[i][len(texts[i]) * 3 // 5:][:2])
    reference = [(o.token_ids, o.text) for o in single.generate(prompts, params)]
    assert all(len(reference[i][0]) < 40 for i in (0, 2, 7)), f"{where}: {[len(t) for t, _ in reference]}"
    several = _engine(llm, max_num_seqs=8, num_decode_steps=4)
    runner, steps, addresses = several.runner, [], set()

    def decode_async(seqs, previous=None, n=1):
        steps.append(n)
        drawn = type(runner).decode_async(runner, seqs, previous, n)
        addresses.update((size, i, a.unsafe_buffer_pointer()) for size, slots in runner._step_slots.items()
                         for i, a in enumerate(slots))
        return drawn

    runner.decode_async = decode_async
    outs = several.generate(prompts, params)
    bad = [i for i in range(8) if (outs[i].token_ids, outs[i].text) != reference[i]]
    assert not bad, f"{where}: requests {bad} differ from single decode steps"
    assert len(outs[1].logprobs) == len(outs[1].token_ids), where
    assert steps.count(4) >= 5 and set(steps) == {1, 4}, f"{where}: steps per program {steps}"
    # Single steps and programs of several read their inputs at the same addresses, step after step (a new address
    # costs the GPU's dispatch a CUDA graph update).
    assert len(addresses) == 2 * len({size for size, _, _ in addresses}), f"{where}: input slots moved {addresses}"
    assert several.blocks.num_used == 0 and not several.has_unfinished(), where


# ---- (d) the block manager --------------------------------------------------------------------------------

def _seq(index: int, prompt_len: int) -> Sequence:
    return Sequence(index, [5] * prompt_len, SamplingParams(), np.zeros(2, np.uint32), prompt_len + 10)


def test_block_manager_accounting():
    blocks = BlockManager(num_blocks=6, block_size=16)
    a, b = _seq(0, 17), _seq(1, 16)
    assert blocks.can_allocate(17 + 16 * 4) and not blocks.can_allocate(16 * 6 + 1)
    blocks.allocate(a, a.num_tokens)
    blocks.allocate(b, b.num_tokens)
    assert (len(a.block_table), len(b.block_table), blocks.num_free, blocks.num_used) == (2, 1, 3, 3)
    assert not set(a.block_table) & set(b.block_table)
    a.num_cached = 17  # 17 cached + the next token fit in its 2 blocks
    assert blocks.new_blocks_to_append(a) == 0
    b.num_cached = 16  # block 1 is full: its next token needs a new block
    assert blocks.new_blocks_to_append(b) == 1
    blocks.append(b)
    assert len(b.block_table) == 2 and blocks.num_free == 2
    with pytest.raises(RuntimeError, match="already holds blocks"):
        blocks.allocate(a, 1)
    blocks.free(a)
    assert a.block_table == [] and blocks.num_free == 4
    c = _seq(2, 64)
    blocks.allocate(c, 64)
    assert blocks.num_free == 0 and blocks.new_blocks_to_append(b) == 0
    b.num_cached = 32
    assert blocks.new_blocks_to_append(b) == 1
    with pytest.raises(RuntimeError, match="needs 1 blocks but only 0 are free"):
        blocks.allocate(_seq(3, 1), 1)
    blocks.free(b)
    blocks.free(c)
    assert blocks.num_free == 6 and blocks.num_used == 0
    stale = _seq(4, 1)
    stale.block_table = [0]
    with pytest.raises(RuntimeError, match="Block 0 of sequence 4 is not in use"):
        blocks.free(stale)


class _NoSwap:
    def can_swap_out(self, seq):
        return False

    def drop(self, seq):
        pass


def test_scheduler_interleaves_chunks_with_decodes():
    """A prompt longer than the step budget (300 tokens, 128 a step) is admitted alone and prefilled in chunks, the
    running request decoding a token in each chunk's step; the next prompt waits for the last chunk."""
    blocks = BlockManager(num_blocks=64, block_size=16)
    scheduler = Scheduler(blocks, _NoSwap(), max_num_seqs=4, max_num_batched_tokens=128,
                          prefill_tokens=lambda lengths: prefill_bucket(sum(packed_length(n) for n in lengths)),
                          chunked_prefill=True)
    for seq in (_seq(0, 20), _seq(1, 300), _seq(2, 10)):
        scheduler.add(seq)
    plan = []
    for _ in range(8):
        step = scheduler.schedule()
        plan.append((step.kind, [seq.index for seq in step.seqs], step.chunk, [seq.index for seq in step.decodes]))
        for seq in step.decodes + step.seqs:  # what the engine does with the step
            seq.num_cached = step.chunk[1] if step.chunk and seq in step.seqs else seq.num_tokens
            if seq.num_cached == seq.num_tokens:
                seq.output_ids.append(7)
    assert plan == [("prefill", [0], None, []), ("chunk", [1], (0, 128), [0]), ("chunk", [1], (128, 256), [0]),
                    ("chunk", [1], (256, 300), [0]), ("prefill", [2], None, []), ("decode", [0, 1, 2], None, []),
                    ("decode", [0, 1, 2], None, []), ("decode", [0, 1, 2], None, [])]


def test_no_blocks_or_host_bytes_leak(tmp_root):
    """After each of several runs (greedy, preempted, sampled) the pool is whole and nothing waits on the host."""
    llm = _llm("llama3", tmp_root)
    prompts, params = _workload()
    engine = _engine(llm, max_num_seqs=8, num_blocks=SCARCE_BLOCKS)
    for run in (params, _sampled_workload(SAMPLING_SEED)[1], params):
        engine.generate(prompts[:12], run[:12])
        assert engine.blocks.num_free == SCARCE_BLOCKS and engine.blocks.num_used == 0
        assert engine.runner.host_bytes_used == 0 and not engine.scheduler.has_work()
    assert engine.stats.swap_outs > 0


@pytest.mark.parametrize("options,message", [
    (dict(block_size=24), "block_size must be a power of two >= 16, got 24"),
    (dict(num_blocks=10), "Request 0 may reach 301 tokens .19 KV blocks. but the pool has only 10 blocks"),
])
def test_bad_options(tmp_root, options, message):
    llm = _llm("llama3", tmp_root)
    with pytest.raises(ValueError, match=message):
        _engine(llm, **options).generate([[5] * 300], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("options,message", [
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be an integer >= 1, got 2.5"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be a number in \(0, 1\], got 1.5"),
    (dict(num_decode_steps=0), "num_decode_steps must be an integer >= 1, got 0"),
    (dict(num_decode_steps=4, offload=True), "num_decode_steps=4 runs decode steps in GPU memory; with offload=True"),
    (dict(prefix_cache_host_gb=1), "prefix_cache_host_gb=1 keeps evicted prefix-cache blocks: it needs"),
    (dict(enable_prefix_caching=True, prefix_cache_host_gb=-1), "prefix_cache_host_gb must be a number >= 0"),
    (dict(enable_prefix_caching=True, offload=True, prefill_policy="xattention"),
     "enable_prefix_caching=True with offload=True needs prefill_policy 'full' .XAttention's estimate reads the "
     "whole prompt., got 'xattention'"),
    (dict(enable_prefix_caching=True, offload=True, prefix_cache_host_gb=1),
     "prefix_cache_host_gb keeps blocks evicted from the GPU pool; an offloaded KV cache"),
])
def test_bad_llm_options(tmp_root, options, message):
    llm = _llm("llama3", tmp_root)
    with pytest.raises(ValueError, match=message):
        LLM.from_params(llm.model_config, llm.params, dtype="float32", **options)


def test_bad_requests(tmp_root):
    engine = _engine(_llm("llama3", tmp_root))
    with pytest.raises(ValueError, match="Got 2 SamplingParams for 1 prompts"):
        engine.generate([[5]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="Prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match="Prompt 0 has 512 tokens; max_model_len 512 leaves no room"):
        engine.generate([[5] * 512], SamplingParams())


# ---- (e) offloaded KV: several requests over one host store ---------------------------------------------------

OFFLOAD = dict(dtype="float32", offload=True, block_size=BLOCK_SIZE, num_ring_slots=4)
OFFLOAD_PROMPTS = 8  # offloaded steps dispatch per block, so fewer requests keep it fast (12 until 2026-11-26)
SCARCE_LEN = 384  # a host store of 24 blocks (the longest request needs 21): the requests preempt one another


def _offload_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """The first 8 requests of the 24-prompt workload the file ran until 2026-11-26, long enough to preempt one
    another in SCARCE_LEN."""
    prompts, params = _workload(24)
    return prompts[:OFFLOAD_PROMPTS], params[:OFFLOAD_PROMPTS]


@functools.cache
def _offloaded(tmp_root, prefill: str, max_model_len: int = 8192) -> LLM:
    _llm("llama3", tmp_root)
    # max_num_seqs: the requests; a chunk step carries a decode row per sequence the engine may run (256 by default).
    return LLM(tmp_root / "llama3", max_model_len=max_model_len, prefill=prefill, max_num_seqs=OFFLOAD_PROMPTS,
               **OFFLOAD)


@functools.cache
def _offloaded_one_at_a_time(tmp_root, prefill: str) -> list[tuple[list[int], str]]:
    llm = _offloaded(tmp_root, prefill)
    return [(o.token_ids, o.text) for o in (llm.generate([p], sp)[0] for p, sp in zip(*_offload_workload()))]


def _offloaded_engine(llm: LLM, max_num_seqs: int) -> BatchEngine:
    return BatchEngine.offloaded(llm._runner, llm.max_model_len, llm.tokenizer, llm.eos_token_ids,
                                 max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)


# Chunked prefill at max_num_seqs 3 too until the suite needed the time (last passed at 07ab582): the recompute test
# below runs these 12 requests at max_num_seqs 8 over the offloaded store, where they queue and are preempted.
@pytest.mark.parametrize("prefill", ["chunked", "layerwise"])
def test_offloaded_batch_equals_one_at_a_time(tmp_root, prefill, monkeypatch, capsys):
    """`LLM(offload=True).generate` with several prompts runs them together over the host store, each request's
    blocks streamed through the ring: the outputs are those of one request at a time, and the store holds no live
    block afterwards. With `progress`, each long prompt's prefill shows a bar (here every prompt counts as long)."""
    from jax_offload import progress

    llm = _offloaded(tmp_root, prefill)
    prompts, params = _offload_workload()
    reference = _offloaded_one_at_a_time(tmp_root, prefill)
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, prefill {prefill}"
    monkeypatch.setattr(progress, "PROGRESS_MIN_TOKENS", 1)
    outs = llm.generate(prompts, params, progress=True)
    assert capsys.readouterr().err.count("prefill:") >= len(prompts), where
    _check(outs, reference, where)
    engine = llm._batch_engine
    assert engine is not None and max(n for kind, n, _, _ in engine.step_log if kind == "decode") > 6, where
    assert engine.overlapped_steps > 0, where  # decode steps dispatched before the previous one's tokens are read
    assert not llm._runner.store.live_blocks(), where
    # A request alone afterwards runs on the one-request path over the same store.
    assert llm.generate([prompts[0]], params[0])[0].token_ids == reference[0][0], where


def test_offloaded_batch_preempts_by_recompute(tmp_root):
    """With a 24-block host store the newest requests give their blocks back and are recomputed later; outputs
    stay those of one request at a time."""
    llm = _offloaded(tmp_root, "chunked", SCARCE_LEN)
    prompts, params = _offload_workload()
    engine = _offloaded_engine(llm, 8)
    outs = engine.generate(prompts, params)
    stats = engine.stats
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, {stats}"
    _check(outs, _offloaded_one_at_a_time(tmp_root, "chunked"), where)
    assert stats.preemptions == stats.recomputes > 0 and stats.swap_outs == 0, where
    assert max(n for kind, n, _, _ in engine.step_log if kind == "decode") <= 8, where
    assert engine.blocks.num_free == SCARCE_LEN // BLOCK_SIZE and not llm._runner.store.live_blocks(), where


@pytest.mark.parametrize("prefill, choice", [("chunked", dict(xattn_threshold=0.9)),
                                             ("layerwise", dict(xattn_density=0.3))])
def test_offloaded_xattention_prompts_together_equal_each_alone(tmp_root, prefill, choice):
    """Offloaded with XAttention prefill (a threshold, or a fixed density) and full decode, prompts given together
    run on the batch engine: each gets its greedy tokens and its prefill density alone, and the store holds no live
    block afterwards."""
    _llm("llama3", tmp_root)
    llm = LLM(tmp_root / "llama3", max_model_len=8192, prefill=prefill, max_num_seqs=OFFLOAD_PROMPTS,
              prefill_policy="xattention", xattn_stride=4, xattn_block=16, **choice, **OFFLOAD)
    prompts, params = _offload_workload()
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, {prefill} {choice}"
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params)
    _check(together, [(o.token_ids, o.text) for o in alone], where)
    assert [o.prefill_density for o in together] == [o.prefill_density for o in alone], where
    assert min(min(o.prefill_density) for o in together) < 1.0, where  # some layer's choice left blocks out
    engine = llm._batch_engine
    assert engine is not None and max(n for kind, n, _, _ in engine.step_log if kind == "decode") > 1, where
    assert not llm._runner.store.live_blocks(), where


@pytest.mark.parametrize("choice", [dict(xattn_threshold=0.9), dict(xattn_density=0.3)])
def test_in_gpu_xattention_prompts_together_equal_each_alone(tmp_root, choice):
    """In GPU memory with XAttention prefill (a threshold, or a fixed density), prompts given together run on the
    batch engine, each prefilled by the one-request runner in a step of its own: each gets its greedy tokens and its
    prefill density alone (the one-request path). At the fixed density also when added one by one through
    `LLM.add_request`, and when a scarce pool preempts them and they are recomputed (their prefill again, then their
    generated tokens as chunks); no block stays used, and their KV never serves a later prompt as a cached prefix."""
    _llm("llama3", tmp_root)
    llm = LLM(tmp_root / "llama3", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=OFFLOAD_PROMPTS,
              prefill_policy="xattention", xattn_stride=4, xattn_block=16, **choice)
    prompts, params = _offload_workload()
    where = f"model seed {MODEL_SEEDS['llama3']}, prompt seed {PROMPT_SEED}, {choice}"
    serial = llm._serial_engine()  # the one-request path, a prompt at a time
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        serial.add_request(f"alone-{i}", prompt, sp)
    alone = run_requests(serial, [f"alone-{i}" for i in range(len(prompts))])
    together = llm.generate(prompts, params)
    _check(together, [(o.token_ids, o.text) for o in alone], where)
    assert [o.prefill_density for o in together] == [o.prefill_density for o in alone], where
    assert min(min(o.prefill_density) for o in together) < 1.0, where  # some layer's choice left blocks out
    steps = llm._batch_engine.step_log
    assert sum(kind == "alone" for kind, *_ in steps) == len(prompts), where
    assert max(n for kind, n, _, _ in steps if kind == "decode") > 1, where
    if "xattn_threshold" in choice:
        return  # the rest runs once, at the fixed density, to spare the suite's time
    # The server's way in: LLM.add_request gives each prompt its own prefill too.
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        llm.add_request(f"served-{i}", prompt, sp)
    served = run_requests(llm, [f"served-{i}" for i in range(len(prompts))])
    _check(served, [(o.token_ids, o.text) for o in alone], f"{where}, LLM.add_request")

    scarce = _engine(llm, max_num_seqs=OFFLOAD_PROMPTS, num_blocks=SCARCE_BLOCKS, swap_space_bytes=0,
                     enable_prefix_caching=True)
    outs = scarce.generate(prompts, params, own_prefills=[llm._own_prefill(p) for p in prompts])
    _check(outs, [(o.token_ids, o.text) for o in alone], f"{where}, scarce pool, {scarce.stats}")
    assert scarce.stats.recomputes > 0 and scarce.blocks.num_used == 0, f"{where}, {scarce.stats}"
    plain = scarce.generate([prompts[0]], params[0])[0]  # a full prefill: nothing XAttention wrote is a prefix of it
    assert plain.num_cached_tokens == 0, where


def test_warm_up_leaves_no_step_to_compile(tmp_root):
    """After `warm_up` (what a server runs before its first request) no step compiles: prefill rows packed from many
    prompts up to the step's token budget (past one prompt's longest), decode at any batch size, greedy, tempered and
    top-p draws, single steps and 4 steps a program. Prompts drawn with seed PROMPT_SEED + 1."""
    import jax.monitoring

    llm = _llm("llama3", tmp_root)
    engine = _engine(llm, max_num_seqs=8, max_num_batched_tokens=1024, num_blocks=120, num_decode_steps=4)
    engine.warm_up()
    steps, decode_async = [], engine.runner.decode_async
    engine.runner.decode_async = lambda seqs, previous=None, n=1: steps.append(n) or decode_async(seqs, previous, n)
    rng = np.random.default_rng(PROMPT_SEED + 1)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=int(n)).tolist() for n in rng.integers(1, 300, 20)]
    params = [SamplingParams(temperature=[0.0, 0.7, 0.9][i % 3], top_p=0.9 if i % 3 == 2 else 1.0, seed=i,
                             max_tokens=int(m)) for i, m in enumerate(rng.integers(1, 40, len(prompts)))]
    compiled: list[str] = []

    def on_compile(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        engine.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    largest = max(n for kind, n, _, _ in engine.step_log if kind == "prefill")
    assert largest > 1 and not compiled, f"{len(compiled)} compiles after warm_up (seed {PROMPT_SEED + 1})"
    assert set(steps) == {1, 4}, f"seed {PROMPT_SEED + 1}: steps per program {steps}"


def test_request_key_is_jax_prngkey():
    """A request's sampling key, made on the host, is `jax.random.PRNGKey(seed)`: negative seeds and seeds past
    32 bits included (drawn with seed PROMPT_SEED + 2)."""
    from jax_offload.sampling import request_key

    rng = np.random.default_rng(PROMPT_SEED + 2)
    seeds = [0, 1, -1, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, *(int(s) for s in rng.integers(-(2**62), 2**62, 20))]
    for seed in seeds:
        assert np.array_equal(request_key(seed), np.asarray(jax.random.PRNGKey(seed))), \
            f"seed {seed} (drawn with {PROMPT_SEED + 2})"


def test_step_due_only_while_a_step_runs_ahead(tmp_root):
    """A server's loop waits for requests (`step_due`) only while a decode step runs ahead, and not past the step
    in flight's expected end; a waiting request makes the next step due at once, and its tokens are still those of
    the request alone, its prefill dispatched before the step in flight is read."""
    import time

    llm = _llm("llama3", tmp_root)
    engine = _engine(llm)
    prompts, params = _workload(2)
    params = [dataclasses.replace(p, max_tokens=40, stop=None) for p in params]
    assert engine.step_due() is None
    engine.add_request("a", prompts[0], params[0])
    dues = []
    while engine.overlapped_steps < 3:
        engine.step()
        dues.append(engine.step_due())
    due, now, step = dues[-1], time.perf_counter(), engine.step_log[-1][3]
    assert due is None or now < due < now + step, (due, now, step)
    engine.add_request("b", prompts[1], params[1])
    assert engine.step_due() is None
    engine.step()  # b's prefill is dispatched behind the decode step in flight, then both are read
    assert engine.prefills_behind == 1 and engine.step_log[-1][0] == "prefill", list(engine.step_log)[-3:]
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output.token_ids
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [outputs["a"], outputs["b"]] == alone


def test_live_rows_of_a_padded_draw_get_the_padded_products_bits(tmp_root):
    """On the CPU a draw's logits are multiplied for its live rows only (the LM head multiplies row by row): each
    live row's logits equal, bit for bit, those of the whole padded product; the padding rows' are 0. Hidden states
    drawn with seed PROMPT_SEED + 3."""
    from jax_offload.serving.model_runner import _last_logits

    llm = _llm("llama3", tmp_root)
    rng = np.random.default_rng(PROMPT_SEED + 3)
    hidden = jax.numpy.asarray(rng.standard_normal((1, 40, llm.model_config.hidden_size)), np.float32)
    index = jax.numpy.asarray(np.r_[rng.integers(0, 40, 5), np.zeros(11)].astype(np.int32))
    whole = np.asarray(_last_logits(llm.model_config, llm.params, hidden, index, None))
    live = np.asarray(_last_logits(llm.model_config, llm.params, hidden, index, np.int32(5)))
    np.testing.assert_array_equal(live[:5], whole[:5], err_msg=f"seed {PROMPT_SEED + 3}")
    assert not live[5:].any(), f"seed {PROMPT_SEED + 3}"
