"""The GPU ring: host blocks stream into at most `num_slots` GPU buffers, transfers enqueued ahead of compute."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import jax

from jax_offload.kv.host_store import HostKVStore


class BlockRing:
    """Streams a schedule of (layer, block) keys from the host store through `num_slots` GPU slots.

    JAX transfers and kernels are asynchronous, and a `device_put` enqueued before a kernel runs under
    it. So when block i is taken, the transfers of up to `num_slots - 1` later blocks are already queued.
    A slot is reused only once the compute that read its block has finished (`release`), which holds GPU
    memory at `num_slots` blocks whatever the context length. With one slot nothing overlaps.
    """

    def __init__(self, store: HostKVStore, num_slots: int, schedule: Iterable[tuple[int, int]]):
        self._store, self._num_slots = store, num_slots
        self._pending = iter(schedule)
        self._next_key = next(self._pending, None)
        self._in_flight: deque[jax.Array] = deque()
        self._busy: deque[jax.Array] = deque()
        self._fill()

    def _fill(self) -> None:
        while self._next_key is not None and len(self._in_flight) + len(self._busy) < self._num_slots:
            layer, index = self._next_key
            self._in_flight.append(jax.device_put(self._store.read(layer, index), self._store.device))
            self._next_key = next(self._pending, None)

    def take(self) -> jax.Array:
        """The next scheduled block, on the GPU (its transfer may still be running; JAX orders the use)."""
        if not self._in_flight:
            raise RuntimeError("The ring's schedule is exhausted.")
        return self._in_flight.popleft()

    def release(self, consumer: jax.Array) -> None:
        """Hands back the slot of the last taken block; `consumer` is a result computed from it."""
        self._busy.append(consumer)
        while self._next_key is not None and len(self._in_flight) + len(self._busy) >= self._num_slots:
            jax.block_until_ready(self._busy.popleft())
        self._fill()
