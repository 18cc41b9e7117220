"""The GPU KV pool's blocks: a free list, each sequence's block table and, with prefix caching, the full blocks of
earlier prompts kept by content.

Prefix caching (vLLM's automatic prefix caching): a block whose `block_size` tokens a prefill computed is keyed by
a SHA-256 chained over every token id from the prompt's start to the block's end, seeded with the engine's
`cache_tag` (model, dtype, KV dtype), so a key names a block's whole prefix and what computed it. A new prompt
takes the blocks whose keys match its own, in order, and prefills only what follows. Blocks are reference-counted; one no sequence holds stays cached in least-recently-freed order and is reused (its key
dropped) only when no never-keyed block is free.

With a host tier (`host_tier`, `host_tier_blocks` > 0) a keyed block is not lost when it is reused: its KV is first
copied to host memory, kept under its key (least recently used dropped first), and a later prompt with that prefix
copies it back into a fresh block instead of recomputing it. The copies are made the moment a block changes hands,
so every later write to the pool is ordered after them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Any, NamedTuple, Protocol

from jax_offload.kv.content_key import chained_key
from jax_offload.serving.sequence import Sequence


class HostTier(Protocol):
    """Where evicted blocks' KV goes and comes back from (the model runner)."""

    def save(self, block: int) -> Any: ...  # a host copy of the block's KV

    def load(self, saved: Any, block: int) -> None: ...  # writes a host copy into the block


class HostHit(NamedTuple):
    """A prefix block found in the host tier (`cached_prefix`): it needs a fresh pool block to be copied into."""

    key: bytes


def cache_tag(*identity: object) -> bytes:
    """The root of a pool's block keys: what computes the KV (the model config, dtype, KV dtype)."""
    return hashlib.sha256("|".join(map(str, identity)).encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 host_tier: HostTier | None = None, host_tier_blocks: int = 0, tag: bytes = b""):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}.")
        if not isinstance(host_tier_blocks, int) or host_tier_blocks < 0:
            raise ValueError(f"host_tier_blocks must be an integer >= 0, got {host_tier_blocks!r}.")
        if host_tier_blocks and (host_tier is None or not enable_prefix_caching):
            raise ValueError(f"A host tier of {host_tier_blocks} blocks holds prefix-cache blocks: it needs a "
                             f"host_tier and enable_prefix_caching=True, got {enable_prefix_caching!r}.")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self._tag = enable_prefix_caching, tag
        self._tier, self.host_tier_blocks = host_tier, host_tier_blocks
        self._host: OrderedDict[bytes, Any] = OrderedDict()  # key -> host copy, least recently used first
        self._loading: set[bytes] = set()  # keys of the host hits an allocation is copying back: never dropped
        self._free: deque[int] = deque(range(num_blocks))  # free and keyed by nothing
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but keyed, least recently freed first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks keyed by content, held or not."""
        return len(self._key_of)

    @property
    def num_host_blocks(self) -> int:
        """Blocks' KV kept in the host tier."""
        return len(self._host)

    def is_cached(self, block: int) -> bool:
        """Whether the block is keyed by content: its KV outlives the sequences that hold it."""
        return block in self._key_of

    def forget_cached(self) -> None:
        """Drops the keys of every cached block no sequence holds (their KV is about to be overwritten by
        something the manager does not see); the host tier's copies stay valid."""
        for block in self._cached:
            del self._block_of[self._key_of.pop(block)]
            self._free.append(block)
        self._cached.clear()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_to_append(self, seq: Sequence, tokens: int = 1) -> int:
        """Blocks `seq` still needs before its next decode steps write the KV of `tokens` tokens (its last first)."""
        return max(self.blocks_for(seq.num_cached + tokens) - len(seq.block_table), 0)

    def cached_prefix(self, seq: Sequence) -> list[int | HostHit]:
        """The cached blocks holding the KV of the sequence's leading tokens, in order: full blocks only, and never
        the block of its last token (whose logits the prefill must compute). A block in the pool is its id, one
        only in the host tier a `HostHit`."""
        if not self.enable_prefix_caching:
            return []
        blocks, key = [], self._tag
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            key = chained_key(key, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self._block_of.get(key)
            if block is None and key not in self._host:
                break
            blocks.append(HostHit(key) if block is None else block)
        return blocks

    def _blocks_taken(self, num_tokens: int, cached: list[int | HostHit]) -> int:
        """Free blocks an allocation takes: new ones (host hits too), and cached ones no sequence holds."""
        in_pool = [b for b in cached if not isinstance(b, HostHit)]
        return self.blocks_for(num_tokens) - len(in_pool) + sum(self._refs[b] == 0 for b in in_pool)

    def can_allocate(self, num_tokens: int, reserve: int = 0, cached: list[int | HostHit] = ()) -> bool:
        """Whether `num_tokens` tokens fit, `reserve` blocks kept free, the first ones being the `cached` blocks
        (`cached_prefix`)."""
        return self.num_free - reserve >= self._blocks_taken(num_tokens, cached)

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int | HostHit] = ()) -> None:
        """Gives a sequence with no blocks enough of them for `num_tokens` tokens, the `cached` blocks of its prefix
        (`cached_prefix`) first, host hits copied back into fresh ones; `seq.num_cached` then counts their
        tokens."""
        if seq.block_table:
            raise RuntimeError(f"Sequence {seq.index} already holds blocks {seq.block_table}.")
        if self._blocks_taken(num_tokens, cached) > self.num_free:
            raise RuntimeError(f"Sequence {seq.index} needs {self._blocks_taken(num_tokens, cached)} blocks but "
                               f"only {self.num_free} are free.")
        # The pool's hits are held before any block is taken, so taking one cannot evict them.
        for block in cached:
            if not isinstance(block, HostHit):
                self._hold(block)
        self._loading = {b.key for b in cached if isinstance(b, HostHit)}
        seq.block_table = [self._load(b.key) if isinstance(b, HostHit) else b for b in cached]
        self._loading = set()
        seq.block_table += [self._take() for _ in range(self.blocks_for(num_tokens) - len(cached))]
        if cached:
            seq.num_cached = seq.num_cached_tokens = len(cached) * self.block_size

    def register(self, seq: Sequence) -> None:
        """Keys the sequence's full blocks whose KV is computed, so later prompts can reuse them (not a prompt's with
        a prefill of its own, CacheBlend's or XAttention's: its KV is not what a full prefill of its tokens
        computes)."""
        if not self.enable_prefix_caching or seq.own_prefill is not None:
            return
        key = self._tag
        tokens = seq.prompt_ids + seq.output_ids
        for i in range(min(seq.num_cached, len(tokens)) // self.block_size):
            key = chained_key(key, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = seq.block_table[i]
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block], self._block_of[key] = key, block

    def append(self, seq: Sequence, tokens: int = 1) -> None:
        """Makes room for the KV its next decode steps write, `tokens` tokens (a new block when the last is full)."""
        for _ in range(self.new_blocks_to_append(seq, tokens)):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            if self._refs[block] == 0:
                raise RuntimeError(f"Block {block} of sequence {seq.index} is not in use; freed twice?")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self.num_used -= 1
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._cached[block]
            self.num_used += 1
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._cached.popitem(last=False)
            key = self._key_of.pop(block)
            del self._block_of[key]
            self._keep_on_host(key, block)
        self._refs[block] = 1
        self.num_used += 1
        return block

    def _keep_on_host(self, key: bytes, block: int) -> None:
        """Copies an evicted block's KV to the host tier (unless it is there already), making room by dropping the
        least recently used copies that no allocation is loading."""
        if not self.host_tier_blocks:
            return
        if key in self._host:
            self._host.move_to_end(key)
            return
        while len(self._host) >= self.host_tier_blocks:
            # The least recently used copy, past the few being loaded: found in a step or two, not a scan.
            oldest = next((k for k in self._host if k not in self._loading), None)
            if oldest is None:
                return
            del self._host[oldest]
        self._host[key] = self._tier.save(block)

    def _load(self, key: bytes) -> int:
        """A fresh block holding the host tier's copy of `key`, keyed by it (the host copy stays, still valid)."""
        block = self._take()
        self._tier.load(self._host[key], block)
        self._host.move_to_end(key)
        self._key_of[block], self._block_of[key] = key, block
        return block

