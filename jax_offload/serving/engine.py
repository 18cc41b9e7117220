"""`BatchEngine`: continuous batching over the already loaded model pieces that `LLM` holds."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jax_offload.attention import check_attention_impl
from jax_offload.config import ModelConfig
from jax_offload.detokenizer import Detokenizer
from jax_offload.kv.host_store import available_host_bytes
from jax_offload.models.params import ModelParams
from jax_offload.offload_runner import OffloadRunner
from jax_offload.outputs import RequestDelta, RequestOutput
from jax_offload.sampling import Drawn, SamplingParams, TokenLogprobs, drawn_to_host, request_key
from jax_offload.serving.block_manager import BlockManager, cache_tag
from jax_offload.serving.model_runner import (PACK_ALIGN, ModelRunner, default_num_blocks, kv_block_bytes,
                                             packed_length, prefill_bucket, steps_suit)
from jax_offload.serving.offload_model_runner import OffloadModelRunner
from jax_offload.serving.scheduler import Scheduler, SchedulerStats, Step
from jax_offload.serving.sequence import PromptKV, Sequence, SequenceStatus
from jax_offload.tensor_parallel import TensorParallel

# The newest steps a batch engine's step log keeps (a server's engine runs on).
STEP_LOG_LENGTH = 1 << 20
# A decode step run ahead is dispatched this share of the step in flight before the device should finish it (at
# least twice the dispatch's own time and half a millisecond); see `BatchEngine.step_due`.
RUN_AHEAD_LEAD = 0.25


class BatchEngine:
    """Generates for many requests at once: new prompts are prefilled together (in GPU memory, one longer than
    `max_num_batched_tokens` alone, in chunks, the running requests decoding a token between two chunks), then
    every running request decodes one token per step, and a finished request's place is taken by the next one.
    `in_gpu` keeps the KV in a paged GPU pool (a decode step is one compiled call); `offloaded` keeps it in the
    pinned host store of an offloaded engine (a decode step streams every running request's blocks through the
    ring).

    In GPU memory, while only running requests decode (nothing waits, is swapped or must be preempted), each
    decode step is dispatched before the previous step's tokens are read: its input tokens stay on the device,
    and the host reads, appends and checks the previous tokens while the device computes. A request that stops
    on a token read that late has one more token drawn, which is dropped. With `num_decode_steps` N > 1 such a
    decode runs N steps in one program where every running request has N tokens to go and draws plainly (greedy or
    tempered, no log-probabilities, EOS allowed): a small batch's step is the host's launch, which N steps share.
    A request that stops within them has the rest of its N tokens dropped, and one that comes meanwhile waits for
    the N steps to end.

    Greedy and seeded results are those of `LLM.generate` one request at a time: the same layer arithmetic,
    attention kernels whose results do not depend on padding or batch, and per-request sampling keys."""

    def __init__(
        self,
        runner: ModelRunner | OffloadModelRunner,
        blocks: BlockManager,
        max_model_len: int,
        tokenizer=None,
        eos_token_ids: Collection[int] = (),
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_decode_steps: int = 1,
    ):
        _check_int("num_decode_steps", num_decode_steps, 1)
        if num_decode_steps > 1 and not isinstance(runner, ModelRunner):
            raise ValueError(f"num_decode_steps={num_decode_steps} runs in GPU memory only; offloaded it must be 1.")
        self.num_decode_steps = num_decode_steps
        self.runner, self.blocks, self.tokenizer = runner, blocks, tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        # In GPU memory a prompt longer than a step is prefilled in chunks; the offloaded runner prefills one prompt
        # at a time in blocks anyway.
        self.scheduler = Scheduler(blocks, runner, max_num_seqs, max_num_batched_tokens, runner.prefill_tokens,
                                   chunked_prefill=isinstance(runner, ModelRunner))
        # (kind, sequences computed, KV tokens read, seconds) of the steps since the last `generate` call began (the
        # newest STEP_LOG_LENGTH: a server's engine runs on); kind "prefill" (whole prompts), "chunk" (one prompt's
        # chunk and a token of each running sequence), "alone" (a prompt with a prefill of its own), "decode".
        self.step_log: deque[tuple[str, int, int, float]] = deque(maxlen=STEP_LOG_LENGTH)
        # Decode steps of the last `generate` call dispatched before the previous step's tokens were read, and
        # prefills dispatched before a decode step's tokens were read.
        self.overlapped_steps = 0
        self.prefills_behind = 0
        self._requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._next_index = 0  # arrival order: lower is older (the scheduler preempts the newest first)
        # A decode step in flight whose draw the host has not read: (step, draw on the device, start time, KV
        # tokens it reads).
        self._pending: tuple[Step, Drawn, float, int] | None = None
        self._last_read = 0.0
        # The device's time for each of the newest decode steps run ahead, and the host's time to schedule and
        # dispatch the newest one: `step_due`'s estimates.
        self._decode_seconds: deque[float] = deque(maxlen=3)
        self._dispatch_seconds = 0.0
        self._due: tuple[Drawn, float | None] | None = None  # step_due's answer for the step in flight
        self._involved: list[Sequence] = []  # the sequences of the step running, for StepFailed

    @classmethod
    def in_gpu(
        cls,
        model_config: ModelConfig,
        params: ModelParams,
        inv_freq: jax.Array,
        dtype: jnp.dtype,
        attention_impl: str,
        max_model_len: int,
        tokenizer=None,
        eos_token_ids: Collection[int] = (),
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        block_size: int = 256,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space_bytes: int | None = None,
        tp: TensorParallel | None = None,
        enable_prefix_caching: bool = False,
        prefix_cache_host_bytes: int = 0,
        reserve_bytes: int = 0,
        num_decode_steps: int = 1,
    ) -> "BatchEngine":
        """`num_blocks` KV blocks of `block_size` tokens (default: what `gpu_memory_utilization` of the device
        memory JAX may use leaves after the weights, and `reserve_bytes` per device for other work);
        `swap_space_bytes` of host memory hold preempted requests' KV (default: half the free host memory, at most
        the pool's size); beyond it preempted requests are recomputed. `tp`: the mesh the (already placed) params
        are split over; the pool is split the same way (one device if None). `enable_prefix_caching`: prompts reuse
        the KV blocks of earlier prompts' equal prefixes (`BlockManager`); `prefix_cache_host_bytes` of pinned host
        memory keep the blocks it evicts. `num_decode_steps`: decode steps a program may run (the class's docstring).
        The options `LLM` shares with this engine are checked by `EngineConfig`."""
        tp = tp or TensorParallel.create(1)
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}.")
        if num_blocks is None:
            num_blocks = default_num_blocks(model_config, dtype, block_size, max_num_seqs, max_model_len,
                                            max_num_batched_tokens, gpu_memory_utilization, tp.size,
                                            params.batch_invariant, params.kv_cache_dtype, reserve_bytes)
            if num_blocks < 1:
                raise ValueError(
                    f"gpu_memory_utilization {gpu_memory_utilization} leaves no memory for KV blocks after the "
                    "weights and activations; raise it or lower max_num_batched_tokens / max_num_seqs.")
        _check_int("num_blocks", num_blocks, 1)
        if swap_space_bytes is None:
            swap_space_bytes = min(available_host_bytes() // 2, num_blocks * kv_block_bytes(
                model_config, dtype, block_size, params.kv_cache_dtype))
        _check_int("swap_space_bytes", swap_space_bytes, 0)
        runner = ModelRunner(
            model_config, params, inv_freq, jnp.dtype(dtype), check_attention_impl(attention_impl), tp,
            num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            swap_space_bytes=swap_space_bytes)
        _check_int("prefix_cache_host_bytes", prefix_cache_host_bytes, 0)
        if prefix_cache_host_bytes > available_host_bytes():
            raise ValueError(f"prefix_cache_host_bytes {prefix_cache_host_bytes} is more than the "
                             f"{available_host_bytes()} bytes of free host memory.")
        blocks = BlockManager(num_blocks, block_size, enable_prefix_caching, runner,
                              prefix_cache_host_bytes // runner.block_bytes,
                              cache_tag(model_config, jnp.dtype(dtype), params.kv_cache_dtype))
        return cls(runner, blocks, max_model_len, tokenizer, eos_token_ids, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, num_decode_steps=num_decode_steps)

    @classmethod
    def offloaded(
        cls,
        runner: OffloadRunner,
        max_model_len: int,
        tokenizer=None,
        eos_token_ids: Collection[int] = (),
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = False,
    ) -> "BatchEngine":
        """Requests share the host store of the offloaded engine's `runner` (its blocks: host_kv_tokens tokens in
        all) and each running one holds a GPU tail slot (a block of every layer); as many slots as
        `gpu_memory_utilization` of the device memory leaves, at most max_num_seqs, bound how many run at
        once. `enable_prefix_caching`: prompts reuse the stored blocks of earlier prompts' equal prefixes, kept in
        the store until their blocks are needed (`BlockManager`)."""
        cfg, dtype = runner.cfg, runner.dtype
        slots = default_num_blocks(cfg, dtype, runner.block_size, max_num_seqs, runner.block_size,
                                   max_num_batched_tokens, gpu_memory_utilization)
        if slots < 1:
            raise ValueError(
                f"gpu_memory_utilization {gpu_memory_utilization} leaves no GPU memory for a request's tail blocks; "
                "raise it or lower block_size.")
        blocks = BlockManager(runner.store.num_blocks, runner.block_size, enable_prefix_caching,
                              tag=cache_tag(cfg, jnp.dtype(dtype), runner.store.kv_cache_dtype))
        return cls(OffloadModelRunner(runner, slots, blocks.is_cached), blocks,
                   max_model_len, tokenizer, eos_token_ids, max_num_seqs=slots,
                   max_num_batched_tokens=max_num_batched_tokens)

    # ---- the incremental API (vLLM's LLMEngine shape): the server and `generate` run this one loop ------------

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                    own_prefill: Callable[[int], PromptKV] | None = None) -> None:
        """Queues a request; it joins the running batch at a coming step (prefix caching as configured).
        `own_prefill`: the prompt is prefilled by it (`Sequence.own_prefill`: CacheBlend, XAttention in GPU memory)
        in a step of its own, then decodes with the batch."""
        if request_id in self._requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if own_prefill is not None and not isinstance(self.runner, ModelRunner):
            raise ValueError("A prompt with a prefill of its own runs with the KV cache in GPU memory, not offloaded.")
        seq = self._sequence(request_id, prompt_ids, params)
        seq.own_prefill = own_prefill
        self.scheduler.add(seq)
        self._requests[request_id] = seq

    def abort(self, request_id: str) -> None:
        """Drops a request wherever it is: its KV blocks (GPU pool, host swap space, host store) are free at
        once. A draw still in flight for it is void. Unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        seq.finish_reason = "abort"
        seq.num_pending = 0
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._pending is not None

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(len(s.running) + (s.chunking is not None), len(s.waiting), len(s.swapped),
                          self.blocks.num_used, self.blocks.num_blocks, self.runner.host_bytes_used)

    def step(self) -> list[RequestDelta]:
        """Runs one scheduled step (or reads the tokens of a decode step in flight) and returns what it added to
        each request. While only running requests decode (in GPU memory or offloaded), a decode step is dispatched
        before the previous one's tokens are read, so the host's bookkeeping overlaps the device's work. If the step
        raises, its requests (and those of a step in flight) are aborted and `StepFailed` names them; the engine goes
        on."""
        deltas: list[RequestDelta] = []
        self._involved = list(self._pending[0].seqs) if self._pending else []
        try:
            self._step(deltas)
        except Exception as error:
            failed = [seq.request_id for seq in self._involved if seq.request_id in self._requests]
            self._pending = None
            for rid in failed:
                self.abort(rid)
            raise StepFailed(failed, error) from error
        return deltas

    def step_due(self) -> float | None:
        """When (`time.perf_counter`) a server's loop should run the next step, if later than now: while a decode
        step is in flight and the next would be dispatched ahead of it, shortly (RUN_AHEAD_LEAD) before the device
        should finish the one in flight, by the fastest of the newest such steps; at once if it has finished. Until
        then the loop waits for requests: one that comes meanwhile is prefilled right after the step in flight, not
        after one more already queued behind it (at 4.6 ms a step, 3.5 ms off its time to first token). None: at
        once."""
        pending = self._pending
        if pending is None or not self._decode_seconds or self.scheduler.waiting:
            return None
        if self._due is None or self._due[0] is not pending[1]:
            due = None
            if self._can_run_ahead():
                seconds = min(self._decode_seconds)
                lead = max(RUN_AHEAD_LEAD * seconds, 2 * self._dispatch_seconds + 0.5e-3)
                due = max(self._last_read, pending[2]) + seconds - lead  # from about when the device took it
            self._due = (pending[1], due)
        due = self._due[1]
        if due is None or due <= time.perf_counter() or pending[1].tokens.is_ready():
            return None
        return due

    def _step(self, deltas: list[RequestDelta]) -> None:
        pending = self._pending
        if pending is not None and not self._can_run_ahead():
            self._pending = None
            self._prefill_behind(pending, deltas)
            return
        if not self.scheduler.has_work():
            self._decode_seconds.clear()  # idle: the next batch's steps take their own time
            return
        scheduled = time.perf_counter()
        step = self.scheduler.schedule()
        self._involved += [*step.seqs, *step.decodes]
        start = time.perf_counter()
        # KV tokens the step reads, before it adds a token.
        kv_tokens = (step.chunk[1] if step.chunk else sum(seq.num_tokens for seq in step.seqs)) \
            + sum(seq.num_tokens for seq in step.decodes)
        if step.kind == "decode":
            steps = self._decode_steps(step.seqs)
            for seq in step.seqs if steps > 1 else ():  # the scheduler made room for one token each
                self.blocks.append(seq, steps)
            # Dispatch this step first, then read the previous one's tokens while the device computes.
            previous = (pending[0].seqs, pending[1]) if pending else None
            drawn = self.runner.decode_async(step.seqs, previous, steps) if steps > 1 else \
                self.runner.decode_async(step.seqs, previous)  # the offloaded runner's takes no `steps`
            for seq in step.seqs:
                seq.num_cached = seq.num_tokens + steps - 1
                seq.num_pending += steps
                if seq.num_tokens >= seq.max_len:
                    self.scheduler.finish(seq)  # its last token is drawn: schedule it no more
            self._pending = (step, drawn, start, kv_tokens)
            if pending is not None:
                self._dispatch_seconds = time.perf_counter() - scheduled
                self.overlapped_steps += 1
                self._decode_seconds.append(self._read(*pending, deltas))
            return
        if step.kind == "chunk":
            (seq,), (begin, end) = step.seqs, step.chunk
            draws = self.runner.prefill_chunk(seq, begin, end, step.decodes)
            seq.num_cached = end
            self.blocks.register(seq)
            for running in step.decodes:
                running.num_cached = running.num_tokens
            if end < seq.num_tokens:  # a chunk before the last: its time counts towards the first token's
                seq.prefill_seconds += time.perf_counter() - start
            drawn_for = [*step.decodes, seq] if end == seq.num_tokens else step.decodes
            self._took(Step("chunk", drawn_for), draws, start, kv_tokens, deltas, rows=1 + len(step.decodes))
            return
        if step.kind == "alone":
            (seq,) = step.seqs
            draws = self.runner.own_prefill(seq)  # none for a recompute: its generated tokens run as chunks next
            seq.num_cached = len(seq.prompt_ids)
            self._took(step, draws, start, kv_tokens, deltas, rows=1)
            return
        draws = self.runner.prefill(step.seqs)  # a prefill: decode, chunk and alone steps returned above
        for seq in step.seqs:
            seq.num_cached = seq.num_tokens
            self.blocks.register(seq)
        self._took(step, draws, start, kv_tokens, deltas)

    def generate(
        self,
        prompts_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        on_text: Callable[[int, str], None] | None = None,
        progress: bool = False,
        own_prefills: list[Callable[[int], PromptKV] | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order; `on_text(i, delta)` streams prompt i's new text; `progress`
        shows a bar of finished requests with the output tokens/s; `own_prefills[i]`: prompt i's own prefill
        (`add_request`)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts_ids)
        if len(params) != len(prompts_ids):
            raise ValueError(f"Got {len(params)} SamplingParams for {len(prompts_ids)} prompts; give one, or one each.")
        if self.has_unfinished():
            raise RuntimeError("generate needs an idle engine; this one still has requests added by add_request.")
        for i, prompt in enumerate(prompts_ids):  # every prompt checked before any runs
            self._check_prompt(f"Prompt {i}", prompt)
        ids = [f"generate-{self._next_index + i}" for i in range(len(prompts_ids))]
        for rid, prompt, p, own in zip(ids, prompts_ids, params, own_prefills or [None] * len(ids)):
            self.add_request(rid, prompt, p, own)
        self.step_log.clear()
        self.overlapped_steps = self.prefills_behind = 0
        offloaded = isinstance(self.runner, OffloadModelRunner)
        if offloaded:  # an offloaded prompt prefills in one step: a bar over it, as the one-request path shows
            self.runner.prefill_bars = progress
        try:
            outputs = run_requests(self, ids, on_text, progress)
        finally:
            self._pending = None  # only these requests' steps can be in flight
            if offloaded:
                self.runner.prefill_bars = False
        if self.blocks.num_used or self.runner.host_bytes_used:
            raise RuntimeError(f"{self.blocks.num_used} KV blocks and {self.runner.host_bytes_used} host bytes "
                               "are still held after every request finished.")
        return outputs

    def warm_up(self) -> None:
        """Compiles the steps a server meets before its first request does (in GPU memory; offloaded steps are
        compiled as requests come): a decode step at every batch size, a prefill at every packed length up to a
        step's budget, the sampled draws at every batch size. Decode runs three tokens: the last step takes its
        input from the one before, still on the device, as a server's steps do; with num_decode_steps N > 1, then
        N + 2, for the program of N steps (one for greedy and sampled draws) and a single step fed from one."""
        if not isinstance(self.runner, ModelRunner):
            return
        n = self.num_decode_steps
        self.runner.warm_up_sampling(n)
        for size in self.runner.buckets:
            if size <= self.blocks.num_blocks:
                self.generate([[0]] * size, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
                if n > 1:
                    self.generate([[0]] * size, SamplingParams(temperature=0.0, max_tokens=n + 2, ignore_eos=True))
        # Packed rows of every length a prefill step can take: its token budget, not one prompt's longest (a
        # server's steps pack many prompts), as far as max_num_seqs prompts and the pool can fill them.
        longest = min(self.max_model_len - 1, self.scheduler.max_chunk)
        piece = max(longest // PACK_ALIGN * PACK_ALIGN, longest if longest < PACK_ALIGN else 0)
        reachable = min(self.scheduler.max_num_batched_tokens, self.scheduler.max_num_seqs * packed_length(piece),
                        (self.blocks.num_blocks - 1) * self.blocks.block_size)
        length, leads = prefill_bucket(PACK_ALIGN), itertools.count(1)  # no packed row is shorter than PACK_ALIGN
        while length <= reachable:
            lengths, left = [], length
            while left > 0:  # prompts whose packed row is exactly `length` tokens
                lengths.append(min(piece, left))
                left -= packed_length(lengths[-1])
            # Each led by a token of its own: no prompt's KV may come from the prefix cache (it would run as chunks).
            prompts = [[next(leads) % self.runner.cfg.vocab_size] + [0] * (n - 1) for n in lengths]
            self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
            length = prefill_bucket(length + 1)

    def _prefill_behind(self, pending: tuple[Step, Drawn, float, int], deltas: list[RequestDelta]) -> None:
        """Reads the decode step in flight; before that, if prompts wait that run whole, dispatches their prefill
        behind it: the host's work for the prefill overlaps the device's for the decode (a new request's time to
        first token)."""
        # The offloaded prefill is the one-request runner's, which reads its draw: nothing to overlap.
        step = self.scheduler.admit_whole_prompts() if isinstance(self.runner, ModelRunner) else None
        if step is None:
            self._read(*pending, deltas)
            return
        self._involved += step.seqs
        drawn = self.runner.prefill_async(step.seqs)
        for seq in step.seqs:
            seq.num_cached = seq.num_tokens
            self.blocks.register(seq)
        self.prefills_behind += 1
        self._read(*pending, deltas)
        # Timed from the decode's read: the time the prefill added.
        self._took(step, drawn_to_host(drawn, len(step.seqs)), self._last_read,
                   sum(seq.num_tokens for seq in step.seqs), deltas)

    def _decode_steps(self, seqs: list[Sequence]) -> int:
        """How many steps the decode of `seqs` (room made for one token each) runs in one program: num_decode_steps
        where nothing else waits for the host, each has that many tokens to go and draws plainly (`steps_suit`),
        and the pool has room for them all; else one."""
        n, s = self.num_decode_steps, self.scheduler
        if n == 1 or s.waiting or s.swapped or s.chunking or not steps_suit(seqs) \
                or any(seq.num_tokens + n > seq.max_len for seq in seqs):
            return 1
        return n if sum(self.blocks.new_blocks_to_append(seq, n) for seq in seqs) <= self.blocks.num_free else 1

    def _can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before the tokens of the one in flight are read: it is then a
        decode of the running sequences that admits, swaps and preempts nothing (those need read tokens)."""
        s = self.scheduler
        if s.waiting or s.swapped or s.chunking or not s.running:
            return False
        return sum(self.blocks.new_blocks_to_append(seq) for seq in s.running) <= self.blocks.num_free

    def _read(self, step: Step, drawn: Drawn, start: float, kv_tokens: int, deltas: list[RequestDelta]) -> float:
        """Reads the draw of a decode step dispatched without waiting (waiting for it now) and takes it; a program
        of several steps, step by step (each timed as an equal share of it). Returns the seconds it added."""
        rounds = [drawn] if drawn.tokens.ndim == 1 else [Drawn(row) for row in np.asarray(drawn.tokens)]
        rounds = [drawn_to_host(r, len(step.seqs)) for r in rounds]
        # A step overlapped with its successor's dispatch is timed from the later of its start and the previous
        # read: the time it added.
        seconds = time.perf_counter() - max(start, self._last_read)
        for k, draws in enumerate(rounds):
            for seq in step.seqs:
                if seq.finish_reason is None:
                    seq.num_pending -= 1
            self._took(step, draws, time.perf_counter() - seconds / len(rounds), kv_tokens + k * len(step.seqs),
                       deltas)
        return seconds

    def _took(self, step: Step, draws: list[tuple[int, TokenLogprobs | None]], start: float, kv_tokens: int,
              deltas: list[RequestDelta], rows: int | None = None) -> None:
        """Takes a step's draws (one for each of step.seqs): timing and the requests' outputs. The step log counts
        `rows` sequences computed (default: those with a token)."""
        seconds = time.perf_counter() - start
        self._last_read = time.perf_counter()
        self.step_log.append((step.kind, len(step.seqs) if rows is None else rows, kv_tokens, seconds))
        for seq, (token, logprobs) in zip(step.seqs, draws):
            if seq.finish_reason is not None:
                continue  # finished by a token read after this step was dispatched, or aborted: its draw is void
            if not seq.output_ids:
                seq.prefill_seconds += seconds
            else:
                seq.step_seconds.append(seconds)
            deltas.append(self._append(seq, token, logprobs))

    @property
    def stats(self) -> SchedulerStats:
        """Preemptions, swaps and recomputes so far (they accumulate across `generate` calls)."""
        return self.scheduler.stats

    # ---- requests -----------------------------------------------------------------------------------------

    def _check_prompt(self, name: str, ids: Seq[int]) -> None:
        if not len(ids):
            raise ValueError(f"{name} is empty; give at least one token.")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{name} has {len(ids)} tokens; max_model_len {self.max_model_len} leaves no room to "
                             "generate.")

    def _sequence(self, request_id: str, ids: Seq[int], params: SamplingParams) -> Sequence:
        ids = [int(i) for i in ids]
        self._check_prompt(f"Request {request_id!r}'s prompt", ids)
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % (2**31))
        key = request_key(seed)
        index = self._next_index
        self._next_index += 1
        return Sequence(index, ids, params, key, min(len(ids) + params.max_tokens, self.max_model_len),
                        request_id=request_id, eos_ids=self.eos_token_ids,
                        detokenizer=Detokenizer(self.tokenizer, params.stop_strings))

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> RequestDelta:
        """Takes a sampled token, and finishes the request on EOS, a stop string or its length (as `LLM` does)."""
        params = seq.params
        early = len(seq.output_ids) < params.min_tokens
        if token in self.eos_token_ids and not params.ignore_eos and not early:
            seq.finish_reason = "stop"
            delta = RequestDelta(seq.request_id, [], "", [])
        else:
            seq.output_ids.append(token)
            if params.logprobs is not None:
                seq.logprobs.append(logprobs)
            text, stopped = seq.detokenizer.add(token, check_stops=not early)
            seq.text = seq.detokenizer.text
            if stopped:
                seq.finish_reason = "stop"
            delta = RequestDelta(seq.request_id, [token], text, [logprobs] if params.logprobs is not None else [])
        # Read tokens only: one still in flight does not count towards the length.
        if seq.finish_reason is None and len(seq.prompt_ids) + len(seq.output_ids) >= seq.max_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.num_pending = 0  # a draw still in flight for it is void
            if seq.status != SequenceStatus.FINISHED:
                self.scheduler.finish(seq)
            self._requests.pop(seq.request_id, None)
            delta.finish_reason, delta.output = seq.finish_reason, self._output(seq)
        return delta

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.prompt_ids, seq.text, seq.output_ids, seq.finish_reason, seq.prefill_seconds,
                             sum(seq.step_seconds), seq.step_seconds, prefill_density=seq.prefill_density,
                             num_cached_tokens=seq.num_cached_tokens,
                             logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                             request_id=seq.request_id)


def run_requests(engine, request_ids: list[str], on_text: Callable[[int, str], None] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
    """Steps `engine` (its requests `request_ids` added) until they finish: their outputs in that order.
    `on_text(i, delta)` streams request_ids[i]'s new text; `progress` shows a bar of finished requests with the
    output tokens/s. Whatever happens, none of the requests is left in the engine."""
    where = {rid: i for i, rid in enumerate(request_ids)}
    outputs: dict[str, RequestOutput] = {}
    began, generated = time.perf_counter(), 0
    with tqdm(total=len(request_ids), desc="requests", unit="req", disable=not progress, dynamic_ncols=True) as bar:
        try:
            while len(outputs) < len(request_ids):
                for delta in engine.step():
                    generated += len(delta.token_ids)
                    if on_text is not None and delta.text:
                        on_text(where[delta.request_id], delta.text)
                    if delta.output is not None:
                        outputs[delta.request_id] = delta.output
                        bar.update(1)
                bar.set_postfix_str(f"{generated / (time.perf_counter() - began):.0f} output tok/s", refresh=False)
        finally:
            for rid in request_ids:
                engine.abort(rid)
    return [outputs[rid] for rid in request_ids]


@dataclasses.dataclass
class EngineLoad:
    """Where an engine's requests are and what they hold (the server's metrics)."""

    running: int
    waiting: int
    swapped: int = 0
    kv_blocks_used: int = 0
    kv_blocks: int = 0
    swap_bytes_used: int = 0


class StepFailed(RuntimeError):
    """An engine step raised: the requests it ran (`request_ids`) are aborted, the engine serves the others."""

    def __init__(self, request_ids: list[str], error: BaseException):
        super().__init__(f"An engine step failed ({type(error).__name__}: {error}); requests {request_ids} are "
                         "aborted.")
        self.request_ids, self.error = request_ids, error


def _check_int(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
