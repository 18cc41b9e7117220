"""Which sequences run in the next step: a prefill of newly admitted prompts, the next chunk of one prompt longer
than a step together with one decode token of every running sequence, or that decode token alone, preempting the
newest ones when the KV pool runs out of blocks."""
from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Protocol

from jax_offload.serving.block_manager import BlockManager
from jax_offload.serving.sequence import Sequence, SequenceStatus


class KVSwapper(Protocol):
    """Moves a sequence's KV blocks between the GPU pool and host memory, and lets go of a sequence's KV when it
    leaves the pool for good or for a recompute (the model runner does it)."""

    def can_swap_out(self, seq: Sequence) -> bool: ...

    def swap_out(self, seq: Sequence) -> None: ...

    def swap_in(self, seq: Sequence) -> None: ...

    def drop(self, seq: Sequence) -> None: ...


@dataclasses.dataclass
class Step:
    # "prefill" (whole prompts), "chunk" (part of one prompt), "alone" (one prompt with a prefill of its own:
    # `Sequence.own_prefill`) or "decode"
    kind: str
    seqs: list[Sequence]
    # A chunk: the prompt's tokens [start, end), the earlier ones already in the pool.
    chunk: tuple[int, int] | None = None
    # A chunk: the running sequences that decode a token in the same step.
    decodes: list[Sequence] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerStats:
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    recomputes: int = 0


class Scheduler:
    """FIFO admission with prefill first (as nano-vllm): a step either prefills prompts or decodes every running
    sequence. When a decode step needs a block and none is free, the newest running sequence is preempted: its
    KV goes to host memory (swap) and comes back before any new prompt is admitted; only when the host budget
    is spent is its KV dropped and recomputed by a later prefill.

    With `chunked_prefill`, a prompt longer than one step's token budget is admitted alone and prefilled in
    chunks (each as large as the budget allows), every step of a chunk also decoding a token of each running
    sequence (vLLM's chunked prefill), so their tokens keep coming while the prompt is prefilled; nothing else is
    admitted meanwhile. The decode tokens ride beside the chunk: the budget bounds the chunk alone, so a chunk's
    bounds never depend on what else runs."""

    def __init__(
        self,
        blocks: BlockManager,
        swapper: KVSwapper,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_tokens: Callable[[list[int]], int],
        chunked_prefill: bool = False,
    ):
        """`prefill_tokens(lengths)` is the padded size of a prefill of prompts of these lengths: the budget
        `max_num_batched_tokens` counts what is computed, padding included."""
        self.blocks, self.swapper = blocks, swapper
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_tokens, self.chunked_prefill = prefill_tokens, chunked_prefill
        # The longest prefill one step may run: what the budget holds, or a single token's padded row if less.
        room = max(max_num_batched_tokens, prefill_tokens([1]))
        self.max_chunk = _largest(lambda n: prefill_tokens([n]) <= room, room)
        self.chunking: Sequence | None = None  # the sequence whose prompt is being prefilled chunk by chunk
        self.waiting: deque[Sequence] = deque()
        # Both oldest first (by index): the newest running sequence is preempted first, the oldest swapped one
        # comes back first.
        self.swapped: list[Sequence] = []
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        need = self.blocks.blocks_for(seq.max_len)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"Request {seq.index} may reach {seq.max_len} tokens ({need} KV blocks) but the pool has only "
                f"{self.blocks.num_blocks} blocks; lower max_tokens or give the pool more blocks."
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running or self.chunking)

    def schedule(self) -> Step:
        if self.chunking is not None:
            return self._next_chunk(self.chunking)
        if self.swapped or self.waiting:
            step = self._admit()
            if step is not None:
                return step
        return Step("decode", self._make_room_for_decode())

    def admit_whole_prompts(self) -> Step | None:
        """The prefill step of the waiting prompts `schedule` would admit while nothing is swapped or chunked, up to
        the first that needs a chunk step or a step alone; it touches no running sequence, so it may be dispatched
        before the tokens of a decode step in flight are read. None if there is no such prompt."""
        if self.chunking is not None or self.swapped:
            return None
        return self._admit(whole_only=True)

    def _admit(self, whole_only: bool = False) -> Step | None:
        """Swaps preempted sequences back in, then admits new prompts; the prefill step of those, if any.
        `whole_only`: stops at a prompt that needs a chunk step or a step alone."""
        # Blocks the running sequences need for their next token stay free, so admitting work never forces an
        # immediate preemption.
        reserve = sum(self.blocks.new_blocks_to_append(s) for s in self.running)
        while (self.swapped and len(self.running) < self.max_num_seqs
               and self.blocks.can_allocate(self.swapped[0].num_cached + 1, reserve)):
            seq = self.swapped.pop(0)
            self.blocks.allocate(seq, seq.num_cached + 1)
            self.swapper.swap_in(seq)
            self.stats.swap_ins += 1
            self._run(seq)
        batch: list[Sequence] = []
        lengths: list[int] = []
        while not self.swapped and self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.own_prefill is not None:
                if batch or whole_only or not self.blocks.can_allocate(seq.num_tokens, reserve):
                    break
                return self._admit_alone(seq)
            # Without chunks one sequence alone may exceed the budget; otherwise no prompt could be longer than it.
            if batch and self.prefill_tokens(lengths + [seq.num_tokens]) > self.max_num_batched_tokens:
                break
            # A cached prefix: in GPU memory the rest of the prompt runs as chunks after it (the chunk step reads
            # earlier KV); offloaded, the runner's prefill starts after it.
            cached = self.blocks.cached_prefix(seq)
            if not self.blocks.can_allocate(seq.num_tokens, reserve, cached):
                break
            if cached and self.chunked_prefill:
                if batch or whole_only:
                    break
                self.waiting.popleft()
                self.blocks.allocate(seq, seq.num_tokens, cached)
                self.chunking = seq
                return self._next_chunk(seq)
            if self.chunked_prefill and not batch and seq.num_tokens > self.max_chunk:
                if whole_only:
                    break
                self.waiting.popleft()
                self.blocks.allocate(seq, seq.num_tokens)
                self.chunking = seq
                return self._next_chunk(seq)
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_tokens, cached)
            batch.append(seq)
            lengths.append(seq.num_tokens)
        for seq in batch:
            self._run(seq)
        return Step("prefill", batch) if batch else None

    def _admit_alone(self, seq: Sequence) -> Step:
        """The step of a prompt with a prefill of its own, alone and from no cached prefix (its blocks take that
        prefill's KV). Recomputed after a preemption, its generated tokens then run as chunks after the prompt."""
        self.waiting.popleft()
        self.blocks.allocate(seq, seq.num_tokens)
        if seq.output_ids:
            self.chunking = seq
        else:
            self._run(seq)
        return Step("alone", [seq])

    def _next_chunk(self, seq: Sequence) -> Step:
        """The prefill step of the sequence's next chunk with a decode token of each running sequence; after its
        last chunk the sequence runs."""
        start = seq.num_cached
        end = min(start + self.max_chunk, seq.num_tokens)
        decodes = self._make_room_for_decode()
        if end == seq.num_tokens:
            self.chunking = None
            self._run(seq)
        return Step("chunk", [seq], (start, end), decodes)

    def _make_room_for_decode(self) -> list[Sequence]:
        # Runs once per decode step over every running sequence: one block-count query per sequence.
        scheduled = []
        while len(scheduled) < len(self.running):
            seq = self.running[len(scheduled)]
            need = self.blocks.new_blocks_to_append(seq)
            while need > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return scheduled
            if need:
                self.blocks.append(seq)
            scheduled.append(seq)
        return scheduled

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_age)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.stats.preemptions += 1
        if self.swapper.can_swap_out(seq):
            self.swapper.swap_out(seq)
            self.stats.swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_age)
        else:
            self.swapper.drop(seq)
            seq.num_cached = 0
            self.stats.recomputes += 1
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.blocks.free(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.swapper.drop(seq)
        self.blocks.free(seq)

    def abort(self, seq: Sequence) -> None:
        """Takes the sequence out wherever it is and lets go of its KV: pool blocks, swapped host copy, stored
        blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq is self.chunking:
            self.chunking = None
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.swapper.drop(seq)
        if seq.block_table:
            self.blocks.free(seq)


def _age(seq: Sequence) -> int:
    return seq.index


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in 1..upper with fits(n) (fits is monotone: true up to some n, false after), at least 1."""
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
