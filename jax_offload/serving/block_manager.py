"""The GPU KV pool's blocks: a free list and each sequence's block table.

There is no prefix caching, so a block has at most one owner and needs no reference count.
"""
from __future__ import annotations

from collections import deque

from jax_offload.serving.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}.")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_to_append(self, seq: Sequence) -> int:
        """Blocks `seq` still needs before its next decode step writes the KV of its last token."""
        return max(self.blocks_for(seq.num_cached + 1) - len(seq.block_table), 0)

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_free - reserve >= self.blocks_for(num_tokens)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Gives a sequence with no blocks enough of them for `num_tokens` tokens."""
        if seq.block_table:
            raise RuntimeError(f"Sequence {seq.index} already holds blocks {seq.block_table}.")
        need = self.blocks_for(num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"Sequence {seq.index} needs {need} blocks but only {self.num_free} are free.")
        seq.block_table = [self._take() for _ in range(need)]

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free >= self.new_blocks_to_append(seq)

    def append(self, seq: Sequence) -> None:
        """Makes room for the KV its next decode step writes (a new block when the last one is full)."""
        for _ in range(self.new_blocks_to_append(seq)):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            if block not in self._used:
                raise RuntimeError(f"Block {block} of sequence {seq.index} is not in use; freed twice?")
            self._used.remove(block)
            self._free.append(block)
        seq.block_table = []

    def _take(self) -> int:
        block = self._free.popleft()
        self._used.add(block)
        return block
