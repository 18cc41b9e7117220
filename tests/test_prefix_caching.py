"""Prefix caching: prompts that start alike reuse the KV blocks an earlier prefill computed, in the GPU pool (with a
host tier, blocks the pool evicts keep their KV in host memory and come back on a later hit) or offloaded in the
host store.

The block manager's bookkeeping (keys chained over the tokens, reference counts, least-recently-freed eviction, the
host tier's copies, no leak over 1,000 requests) is checked on its own against a model of the pool's contents; the
engine's outputs with caching equal those without it (greedy, tiny Llama, float32 and bfloat16), with the reused
tokens reported.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams
from jax_offload.serving.block_manager import BlockManager, HostHit
from jax_offload.serving.sequence import Sequence


def _seq(index: int, ids: list[int]) -> Sequence:
    return Sequence(index, list(ids), SamplingParams(), np.zeros(2, np.uint32), len(ids) + 8)


class FakePool:
    """What each pool block holds (the prompt prefix whose last block it is), and a host tier that copies it."""

    def __init__(self, num_blocks: int):
        self.content: list[tuple | None] = [None] * num_blocks
        self.saves = self.loads = 0

    def save(self, block: int):
        self.saves += 1
        return self.content[block]

    def load(self, saved, block: int) -> None:
        self.loads += 1
        self.content[block] = saved


def _prefill(blocks: BlockManager, seq: Sequence, pool: FakePool | None = None) -> None:
    """Allocates with the cached prefix, checks the reused blocks hold that prefix, and "computes" the rest."""
    cached = blocks.cached_prefix(seq)
    blocks.allocate(seq, seq.num_tokens, cached)
    size = blocks.block_size
    if pool is not None:
        for i, block in enumerate(seq.block_table):
            prefix = tuple(seq.token_ids[:(i + 1) * size])
            if i < len(cached):
                assert pool.content[block] == prefix, (seq.index, i, block)
            else:
                pool.content[block] = prefix
    seq.num_cached = seq.num_tokens
    blocks.register(seq)


def test_blocks_are_shared_by_prefix_and_evicted_least_recently_freed():
    blocks = BlockManager(6, 4, enable_prefix_caching=True)
    a = _seq(0, range(10))  # blocks [0..3], [4..7] full, [8, 9] partial
    _prefill(blocks, a)
    b = _seq(1, list(range(8)) + [50, 51, 52])
    _prefill(blocks, b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    c = _seq(2, list(range(4)) + [60] * 5)  # shares the first block only
    _prefill(blocks, c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert blocks.num_used == 3 + 1 + 2 and blocks.num_free == 0
    d = _seq(3, list(range(8)))  # its last token's block is computed, never reused: one block shared
    assert blocks.cached_prefix(d) == a.block_table[:1]
    for seq in (a, b, c):
        blocks.free(seq)
    assert blocks.num_used == 0 and blocks.num_free == 6
    _prefill(blocks, d)
    assert d.num_cached_tokens == 4
    blocks.free(d)
    # A fresh prompt needs every block: the cached ones are evicted, their keys dropped.
    e = _seq(4, [90 + i for i in range(24)])
    _prefill(blocks, e)
    assert blocks.cached_prefix(_seq(5, list(range(10)))) == []
    blocks.free(e)


def test_host_tier_keeps_evicted_blocks_and_copies_them_back():
    pool = FakePool(4)
    blocks = BlockManager(4, 4, enable_prefix_caching=True, host_tier=pool, host_tier_blocks=2)
    a = _seq(0, range(9))  # two full blocks and a partial one
    _prefill(blocks, a, pool)
    blocks.free(a)
    b = _seq(1, [50 + i for i in range(16)])  # takes every block: a's two keyed blocks go to the host tier
    _prefill(blocks, b, pool)
    assert pool.saves == 2 and blocks.num_host_blocks == 2 and blocks.num_cached_blocks == 4
    blocks.free(b)
    again = _seq(2, list(range(8)) + [7, 7])
    cached = blocks.cached_prefix(again)
    assert all(isinstance(c, HostHit) for c in cached) and len(cached) == 2
    _prefill(blocks, again, pool)  # checks the copied-back blocks hold a's prefix
    assert pool.loads == 2 and again.num_cached_tokens == 8
    # The two copies back evicted two of b's blocks, which found the host tier full of the copies being loaded
    # (never dropped) and were lost; the third block evicted one more, which took the place of a's first block.
    assert pool.saves == 3 and blocks.num_host_blocks == 2
    assert blocks.cached_prefix(_seq(3, list(range(8)) + [1])) == again.block_table[:2]
    blocks.free(again)


@pytest.mark.parametrize("host_tier_blocks", [0, 6], ids=["pool", "host-tier"])
def test_no_block_leaks_over_a_thousand_requests(host_tier_blocks):
    rng = random.Random(11)
    pool = FakePool(64)
    blocks = BlockManager(64, 8, enable_prefix_caching=True, host_tier=pool, host_tier_blocks=host_tier_blocks)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(0, 40))] for _ in range(5)]
    live: list[Sequence] = []
    for i in range(1000):
        ids = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
        seq = _seq(i, ids)
        while not blocks.can_allocate(seq.num_tokens, 0, blocks.cached_prefix(seq)):
            blocks.free(live.pop(0))
        _prefill(blocks, seq, pool)
        live.append(seq)
        if rng.random() < 0.5:
            blocks.free(live.pop(rng.randrange(len(live))))
    for seq in live:
        blocks.free(seq)
    assert blocks.num_used == 0 and blocks.num_free == 64, "seed 11"
    assert blocks.num_host_blocks <= host_tier_blocks and (pool.loads > 0) == (host_tier_blocks > 0), "seed 11"


MODEL_SEED, PROMPT_SEED = 4301, 4302


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_models.build_in(tmp_path_factory, "llama3", MODEL_SEED)


def test_reused_prefix_gives_the_same_tokens(tiny_llama):
    """bfloat16: a prompt prefilled after its cached blocks (a chunk over them) gives the tokens of one prefilled
    whole (the other tests here compare float32)."""
    rng = np.random.default_rng(PROMPT_SEED)
    system = rng.integers(3, tiny_models.VOCAB, size=600).tolist()  # two full blocks of 256 and a partial one

    def ask(n: int) -> list[int]:
        return system + rng.integers(3, tiny_models.VOCAB, size=n).tolist()

    first, second = [ask(20), ask(7)], [ask(33), ask(90), rng.integers(3, tiny_models.VOCAB, size=50).tolist()]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}"
    plain = LLM(tiny_llama, dtype="bfloat16", max_model_len=1024, max_num_seqs=4)
    cached = LLM(tiny_llama, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, enable_prefix_caching=True)
    for prompts in (first, second):
        want = [o.token_ids for o in plain.generate(prompts, greedy)]
        outs = cached.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == want, where
    # The first batch computed the shared blocks once; every later prompt on the system prompt reused both.
    assert [o.num_cached_tokens for o in outs] == [512, 512, 0], where
    assert cached._batch_engine.blocks.num_used == 0, where


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "swap"])
def test_preemption_keeps_outputs_with_shared_blocks(tiny_llama, swap_blocks):
    """A pool of 14 blocks of 16 tokens for 10 requests on two shared prefixes: requests are preempted (swapped,
    or recomputed when host room is short) while others hold their prefix blocks."""
    from jax_offload.serving.engine import BatchEngine

    rng = np.random.default_rng(PROMPT_SEED + 1)
    prefixes = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (40, 70)]
    prompts = [prefixes[i % 2] + rng.integers(3, tiny_models.VOCAB, size=int(n)).tolist()
               for i, n in enumerate(rng.integers(1, 30, 10))]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(8, 40, 10)]
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256)
    kv_block = 2 * llm.model_config.num_layers * 16 * llm.model_config.num_kv_heads * llm.model_config.head_dim * 4

    def engine(num_blocks: int, caching: bool) -> BatchEngine:
        return BatchEngine.in_gpu(llm.model_config, llm.params, llm._inv_freq, llm.dtype, llm.attention_impl,
                                  llm.max_model_len, block_size=16, num_blocks=num_blocks, max_num_seqs=6,
                                  max_num_batched_tokens=512, swap_space_bytes=swap_blocks * kv_block,
                                  enable_prefix_caching=caching)

    want = [o.token_ids for o in engine(14, False).generate(prompts, params)]  # the same shapes: compiled once
    cached = engine(14, True)
    outs = cached.generate(prompts, params)
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED + 1}, {cached.stats}"
    assert [o.token_ids for o in outs] == want, where
    assert cached.stats.preemptions > 0 and sum(o.num_cached_tokens for o in outs) > 0, where
    assert (cached.stats.swap_outs > 0) == (swap_blocks > 0), where
    assert cached.blocks.num_used == 0 and cached.blocks.num_free == 14, where


def test_prefix_comes_back_from_the_host_tier(tiny_llama):
    """A pool of 14 blocks of 16 tokens: two unrelated prompts evict a system prompt's blocks, which the host tier
    keeps; the next prompt on that system prompt copies them back and gives the tokens a plain engine gives."""
    from jax_offload.serving.engine import BatchEngine

    rng = np.random.default_rng(PROMPT_SEED + 2)
    system = rng.integers(3, tiny_models.VOCAB, size=64).tolist()  # four full blocks
    first, last = (system + rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (5, 9))
    others = [rng.integers(3, tiny_models.VOCAB, size=90).tolist() for _ in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256)
    kv_block = 2 * llm.model_config.num_layers * 16 * llm.model_config.num_kv_heads * llm.model_config.head_dim * 4

    def engine(caching: bool) -> BatchEngine:
        return BatchEngine.in_gpu(llm.model_config, llm.params, llm._inv_freq, llm.dtype, llm.attention_impl,
                                  llm.max_model_len, block_size=16, num_blocks=14, max_num_seqs=2,
                                  max_num_batched_tokens=512, enable_prefix_caching=caching,
                                  prefix_cache_host_bytes=16 * kv_block if caching else 0)

    plain, cached = engine(False), engine(True)
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED + 2}"
    for prompts in ([first], others, [last]):
        if prompts == [last]:
            hits = cached.blocks.cached_prefix(_seq(9, last))
            assert len(hits) == 4 and all(isinstance(h, HostHit) for h in hits), where
        outs = cached.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, greedy)], where
    assert outs[0].num_cached_tokens == 64 and cached.blocks.num_used == 0, where


@pytest.mark.parametrize("prefill", ["chunked", "layerwise"])
def test_offloaded_store_reuses_prefixes(tiny_llama, prefill):
    """Offloaded, 16-token blocks in a host store of 10: prompts on two shared prefixes reuse their stored blocks
    (also across calls), requests are preempted (recomputed) while others hold shared blocks, and the tokens are
    a plain offloaded engine's (float32 greedy; a layerwise prefill after a cached prefix runs chunk by chunk)."""
    rng = np.random.default_rng(PROMPT_SEED + 3)
    prefixes = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (40, 70)]
    prompts = [prefixes[i % 2] + rng.integers(3, tiny_models.VOCAB, size=int(n)).tolist()
               for i, n in enumerate(rng.integers(1, 30, 6))]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(8, 40, 6)]
    options = dict(dtype="float32", max_model_len=160, offload=True, block_size=16, num_ring_slots=4,
                   prefill=prefill, max_num_seqs=4)
    plain, cached = LLM(tiny_llama, **options), LLM(tiny_llama, enable_prefix_caching=True, **options)
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED + 3}, prefill {prefill}"
    want = [o.token_ids for o in plain.generate(prompts, params)]
    first = cached.generate(prompts[:2], params[:2])
    outs = cached.generate(prompts, params)
    engine = cached._batch_engine
    where += f", {engine.stats}"
    assert [o.token_ids for o in first + outs] == want[:2] + want, where
    # The first call's prompts come back whole: every full block but the last token's is reused.
    assert [o.num_cached_tokens for o in outs[:2]] == [(len(p) - 1) // 16 * 16 for p in prompts[:2]], where
    assert sum(o.num_cached_tokens for o in outs[2:]) > 0 and engine.stats.preemptions > 0, where
    assert engine.blocks.num_used == 0 and engine.blocks.num_cached_blocks > 0, where
    # The one-request path writes over the store: the cached blocks are let go first.
    cached.logits(prompts[0], last=1)
    assert engine.blocks.num_cached_blocks == 0, where
