"""The GPU ring: host blocks stream into at most `num_slots` GPU buffers, transfers enqueued ahead of compute."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import jax

from jax_offload.kv.host_store import HostKVStore

Key = tuple[int, int]  # (layer, block index)


def group_size(num_slots: int) -> int:
    """Blocks moved and attended together: half the ring, so one group can compute while the next moves.
    Groups amortise the per-call cost of Python dispatch, which otherwise rivals a block's transfer."""
    return max(1, num_slots // 2)


def grouped(keys: Sequence[Key], size: int) -> list[list[Key]]:
    return [list(keys[i : i + size]) for i in range(0, len(keys), size)]


def padded(group: Sequence, size: int, fill=None) -> tuple:
    """A group (its blocks, or what goes with each) filled up to `size` with `fill`, or with its last entry: groups
    then come in a few shapes, so the programs that read them compile once per shape instead of once per group
    length (each ~1-2 s for the 8B shape on an H100); the reader masks the repeats out."""
    return tuple(group) + (group[-1] if fill is None else fill,) * (size - len(group))


def decode_group_size(num_blocks: int, group: int) -> int:
    """The size a decode step pads a group of `num_blocks` to: the next power of two, at most `group`. A long
    generation then meets at most log2(group) + 1 group shapes, each compiled once, while a step copies at most
    num_blocks - 1 repeated blocks (a prefill chunk pads to the whole group: its attention, not a copy, dominates)."""
    return min(group, 1 << (num_blocks - 1).bit_length())


class BlockRing:
    """Streams groups of (layer, block) keys from the host store through `num_slots` GPU slots.

    JAX transfers and kernels are asynchronous, and a `device_put` enqueued before a kernel runs under
    it. So when a group is taken, the transfers of later groups are already queued as far as free
    slots allow. A slot is reused only once the compute that read its block has finished (`release`),
    which holds GPU memory at `num_slots` blocks whatever the context length. With one slot nothing
    overlaps.
    """

    def __init__(self, store: HostKVStore, num_slots: int, schedule: Iterable[list[Key]]):
        self._store, self._num_slots = store, num_slots
        self._pending = iter(schedule)
        self._next = next(self._pending, None)
        self._in_flight: deque[list[jax.Array]] = deque()
        self._busy: deque[tuple[jax.Array, int]] = deque()
        self._fill()

    def _used(self) -> int:
        return sum(len(g) for g in self._in_flight) + sum(n for _, n in self._busy)

    def _fill(self) -> None:
        while self._next is not None and self._used() + len(self._next) <= self._num_slots:
            self._in_flight.append(self._store.fetch(self._next))
            self._next = next(self._pending, None)

    def take(self) -> list[jax.Array]:
        """The next scheduled group, on the GPU (transfers may still run; JAX orders the use)."""
        if not self._in_flight:
            raise RuntimeError("The ring's schedule is exhausted.")
        return self._in_flight.popleft()

    def release(self, consumer: jax.Array, num_blocks: int) -> None:
        """Hands back the slots of the last taken group; `consumer` is a result computed from it."""
        self._busy.append((consumer, num_blocks))
        while self._next is not None and self._busy and self._used() + len(self._next) > self._num_slots:
            jax.block_until_ready(self._busy.popleft()[0])
        self._fill()
