"""The GPU KV pool's blocks: a free list, each sequence's block table and, with prefix caching, the full blocks of
earlier prompts kept by content.

Prefix caching (vLLM's automatic prefix caching): a block whose `block_size` tokens a prefill computed is keyed by
a hash chained over every token id from the prompt's start to the block's end, so a key names a block's whole
prefix. A new prompt takes the blocks whose keys match its own, in order, and prefills only what follows. Blocks
are reference-counted; one no sequence holds stays cached in least-recently-freed order and is reused (its key
dropped) only when no never-keyed block is free.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from jax_offload.serving.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}.")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # free and keyed by nothing
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but keyed, least recently freed first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.num_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks keyed by content, held or not."""
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_to_append(self, seq: Sequence) -> int:
        """Blocks `seq` still needs before its next decode step writes the KV of its last token."""
        return max(self.blocks_for(seq.num_cached + 1) - len(seq.block_table), 0)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the KV of the sequence's leading tokens, in order: full blocks only, and never
        the block of its last token (whose logits the prefill must compute)."""
        if not self.enable_prefix_caching:
            return []
        blocks, key = [], None
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            key = _chain(key, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _blocks_taken(self, num_tokens: int, cached: list[int]) -> int:
        """Free blocks an allocation takes: new ones, and cached ones no sequence holds."""
        return self.blocks_for(num_tokens) - len(cached) + sum(self._refs[b] == 0 for b in cached)

    def can_allocate(self, num_tokens: int, reserve: int = 0, cached: list[int] = ()) -> bool:
        """Whether `num_tokens` tokens fit, `reserve` blocks kept free, the first ones being the `cached` blocks
        (`cached_prefix`)."""
        return self.num_free - reserve >= self._blocks_taken(num_tokens, cached)

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> None:
        """Gives a sequence with no blocks enough of them for `num_tokens` tokens, the `cached` blocks of its prefix
        (`cached_prefix`) first; `seq.num_cached` then counts their tokens."""
        if seq.block_table:
            raise RuntimeError(f"Sequence {seq.index} already holds blocks {seq.block_table}.")
        if self._blocks_taken(num_tokens, cached) > self.num_free:
            raise RuntimeError(f"Sequence {seq.index} needs {self._blocks_taken(num_tokens, cached)} blocks but "
                               f"only {self.num_free} are free.")
        for block in cached:
            self._hold(block)
        seq.block_table = list(cached) + [self._take() for _ in range(self.blocks_for(num_tokens) - len(cached))]
        if cached:
            seq.num_cached = seq.num_cached_tokens = len(cached) * self.block_size

    def register(self, seq: Sequence) -> None:
        """Keys the sequence's full blocks whose KV is computed, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        key = None
        tokens = seq.prompt_ids + seq.output_ids
        for i in range(min(seq.num_cached, len(tokens)) // self.block_size):
            key = _chain(key, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = seq.block_table[i]
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block], self._block_of[key] = key, block

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free >= self.new_blocks_to_append(seq)

    def append(self, seq: Sequence) -> None:
        """Makes room for the KV its next decode step writes (a new block when the last one is full)."""
        for _ in range(self.new_blocks_to_append(seq)):
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
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        self.num_used += 1
        return block


def _chain(previous: int | None, tokens: list[int]) -> int:
    """The key of a block: its tokens and the key of the block before it."""
    return hash((previous, tuple(tokens)))
