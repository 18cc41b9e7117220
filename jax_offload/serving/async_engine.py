"""The server's engine: `EngineCore` runs an `LLM` (commands in; deltas, errors and prompt log-probabilities out),
and a front hands its output to the HTTP handlers' asyncio queues. `EngineLoop` runs the core on a thread of this
process; `EngineProcess` runs it in a process of its own (vLLM V1's engine core), so the engine's Python and the
event loop's per-token work do not share one interpreter lock. One thread (of one process) makes every JAX call.
A request added while others decode joins the running batch at the next step."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import numpy as np

from jax_offload.outputs import RequestDelta
from jax_offload.sampling import SamplingParams, TokenLogprobs
from jax_offload.serving.engine import EngineLoad, StepFailed
from jax_offload.serving.protocol import BadRequest


class EngineFailure(RuntimeError):
    """The engine failed while running a request (the server answers 500 and goes on)."""


@dataclasses.dataclass
class ModelInfo:
    """What the HTTP side needs of the model: tokenizer (None: token ids only), window, vocabulary."""

    tokenizer: object
    max_model_len: int
    vocab_size: int

    @classmethod
    def of(cls, llm) -> "ModelInfo":
        return cls(llm.tokenizer, llm.max_model_len, llm.model_config.vocab_size)


# Commands: ("add", request_id, prompt_ids, params), ("score", request_id, prompt_ids, num_logprobs),
# ("abort", request_id), ("call", call_id, fn, args).
# How often a loop waiting for a step to be due looks whether the step in flight has finished.
DUE_POLL_SECONDS = 0.25e-3

Emit = Callable[[list[tuple[str, object]], EngineLoad | None, tuple[int, int] | None], None]


class EngineCore:
    """Runs `llm`: `take` a command, `run_once` a step; what comes out goes to `emit(items, load, host_bytes)`
    ((request id, item) pairs: a `RequestDelta`, a `BadRequest` or `EngineFailure`, or a prompt's
    log-probabilities; after a step, the engine's load and host-store bytes too)."""

    def __init__(self, llm, emit: Emit):
        self.llm, self.emit = llm, emit
        self._scores: deque[tuple[str, list[int], int]] = deque()
        self._live: set[str] = set()  # requests added and not finished

    @property
    def busy(self) -> bool:
        return self.llm.has_unfinished() or bool(self._scores)

    def take(self, command: tuple) -> None:
        kind = command[0]
        if kind == "abort":
            self.llm.abort(command[1])
            self._live.discard(command[1])
            self._scores = deque(s for s in self._scores if s[0] != command[1])
        elif kind == "score":
            self._scores.append(command[1:])
        elif kind == "call":
            _, call_id, fn, args = command
            try:
                result = fn(self.llm, *args)
            except Exception as error:  # noqa: BLE001 - handed to the caller
                result = EngineFailure(f"{type(error).__name__}: {error}")
            self.emit([(call_id, result)], None, None)
        else:
            _, request_id, prompt_ids, params = command
            try:
                self.llm.add_request(request_id, prompt_ids, params)
            except ValueError as error:
                self.emit([(request_id, BadRequest(str(error)))], None, None)
                return
            self._live.add(request_id)

    def step_due(self) -> float | None:
        """When to run the next step if not at once (`LLM.step_due`): prompts to score run at once."""
        return None if self._scores else self.llm.step_due()

    def run_once(self) -> None:
        self._score_when_free()
        if self.llm.has_unfinished():
            self._step()

    def _score_when_free(self) -> None:
        """Scores waiting prompts: at once in GPU memory; offloaded only while no request runs, since the
        one-request prefill it takes writes over the host store the running requests share."""
        while self._scores and not (self.llm.engine_config.offload and self.llm.has_unfinished()):
            request_id, ids, num_logprobs = self._scores.popleft()
            try:
                item = prompt_logprobs(self.llm.logits(ids), ids, num_logprobs)
            except ValueError as error:
                item = BadRequest(str(error))
            except Exception as error:  # noqa: BLE001 - the server answers 500 and goes on
                item = EngineFailure(f"Scoring the prompt failed: {type(error).__name__}: {error}")
            self.emit([(request_id, item)], None, None)

    def _step(self) -> None:
        try:
            deltas = self.llm.step()
        except StepFailed as failed:
            self._live.difference_update(failed.request_ids)
            self.emit([(rid, EngineFailure(str(failed))) for rid in failed.request_ids], None, None)
            return
        except Exception as error:  # noqa: BLE001 - a step that fails outside the engine's guard fails everyone
            failure = EngineFailure(f"The engine failed: {type(error).__name__}: {error}")
            for rid in self._live:
                self.llm.abort(rid)
            self.emit([(rid, failure) for rid in self._live], None, None)
            self._live.clear()
            return
        for delta in deltas:
            if delta.finished:
                self._live.discard(delta.request_id)
        self.emit([(d.request_id, d) for d in deltas], self.llm.load(), self.llm.host_store_bytes())


class _Front:
    """The handlers' side of an engine: requests in, each request's items into its asyncio queue. Subclasses send
    commands to their core (`_send`) and hand its output to `_deliver`."""

    def __init__(self, observe: Callable[[list[RequestDelta], EngineLoad, tuple[int, int]], None] | None):
        self.observe = observe
        self.info: ModelInfo | None = None
        self._sinks: dict[str, _Sink] = {}
        self._waiting = 0  # requests added whose first token has not come: the back-pressure count
        self._calls = itertools.count()

    @property
    def num_waiting(self) -> int:
        return self._waiting

    def _send(self, command: tuple) -> None:
        raise NotImplementedError

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[list[RequestDelta]]:
        """The request's deltas as steps produce them, each time all that have come (a busy event loop then
        writes several tokens at once); the last has `output`. Leaving early aborts the request."""
        items = self._open(request_id)
        self._waiting += 1
        self._send(("add", request_id, prompt_ids, params))
        finished = first = False
        try:
            while not finished:
                batch = [await items.get()]
                while not items.empty():
                    batch.append(items.get_nowait())
                for item in batch:
                    if isinstance(item, Exception):
                        finished = True
                        raise item
                if not first:
                    first = True
                    self._waiting -= 1
                finished = batch[-1].finished
                yield batch
        finally:
            if not first:
                self._waiting -= 1
            self._sinks.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    async def prompt_logprobs(self, request_id: str, prompt_ids: list[int], num_logprobs: int
                              ) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability given the tokens before it (None for the first), with the
        `num_logprobs` likeliest tokens at each position."""
        return await self._one(request_id, ("score", request_id, prompt_ids, num_logprobs))

    async def call(self, fn: Callable, *args):
        """fn(llm, *args) run by the engine between steps (in its process): benchmarks' and tests' access to the
        engine; `fn` must be picklable (a module-level function) for `EngineProcess`."""
        call_id = f"call-{next(self._calls)}"
        return await self._one(call_id, ("call", call_id, fn, args))

    async def _one(self, key: str, command: tuple):
        items = self._open(key)
        self._send(command)
        try:
            item = await items.get()
        finally:
            self._sinks.pop(key, None)
        if isinstance(item, Exception):
            raise item
        return item

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _open(self, key: str) -> asyncio.Queue:
        items: asyncio.Queue = asyncio.Queue()
        self._sinks[key] = _Sink(asyncio.get_running_loop(), items)
        return items

    def _deliver(self, items: list[tuple[str, object]], load: EngineLoad | None,
                 host_bytes: tuple[int, int] | None) -> None:
        """Puts a step's items into their queues with one wake-up of each event loop, not one per request (called
        from the engine's thread or the reader thread)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, object]]] = {}
        for key, item in items:
            sink = self._sinks.get(key)
            if sink is not None:
                by_loop.setdefault(sink.loop, []).append((sink, item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)
        if load is not None and self.observe is not None:
            self.observe([item for _, item in items if isinstance(item, RequestDelta)], load, host_bytes)


class EngineLoop(_Front):
    """The core on a thread of this process, over an `LLM` built here (tests, notebooks)."""

    def __init__(self, llm, observe=None):
        super().__init__(observe)
        self.llm, self.info = llm, ModelInfo.of(llm)
        self._core = EngineCore(llm, self._deliver)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jax_offload-engine", daemon=True)

    def start(self, warm_up: bool = False) -> None:
        """Starts the engine thread (once; a second call does nothing)."""
        if self._thread.is_alive():
            return
        if warm_up:
            self.llm.warm_up()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    def _run(self) -> None:
        def get(timeout: float | None) -> tuple | None:
            return self._commands.get(timeout=timeout) if timeout != 0 else self._commands.get_nowait()

        _drive(self._core, get, queue.Empty, self._stop.is_set)


class EngineProcess(_Front):
    """The core in a process of its own (spawned: JAX does not survive a fork), over the `LLM` that `build()`
    makes there; `build` must be picklable (a module-level function or a partial of one). Its output comes back
    over a pipe, read by a thread of this process."""

    def __init__(self, build: Callable[[], object], observe=None):
        super().__init__(observe)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_process, args=(build, child), name="jax_offload-engine",
                                         daemon=True)
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="jax_offload-engine-reader", daemon=True)

    def start(self, warm_up: bool = False) -> None:
        """Starts the process and waits until its engine is built (and warmed up); a second call does nothing."""
        if self.info is not None:
            return
        self._process.start()
        self._send(("start", warm_up))
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            kind, payload = "error", f"it exited with code {self._process.exitcode}"
        if kind != "ready":
            raise RuntimeError(f"The engine process failed to start: {payload}")
        self.info = payload
        self._reader.start()

    def stop(self) -> None:
        if self._process.is_alive():
            try:
                self._send(("stop",))
            except (BrokenPipeError, OSError):
                pass  # it is ending already
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def _send(self, command: tuple) -> None:
        with self._send_lock:
            self._conn.send(command)

    def _read(self) -> None:
        while True:
            try:
                deltas, items, load, host_bytes = self._conn.recv()
            except (EOFError, OSError):
                failure = EngineFailure("The engine process ended.")
                self._deliver([(key, failure) for key in list(self._sinks)], None, None)
                return
            self._deliver([(fields[0], RequestDelta(*fields)) for fields in deltas] + items, load, host_bytes)


def _engine_process(build: Callable[[], object], conn) -> None:
    """The engine process: builds the LLM, says "ready" with its ModelInfo, then runs commands and steps."""
    threading.Thread(target=_end_with_parent, name="jax_offload-engine-parent", daemon=True).start()
    try:
        _, warm_up = conn.recv()
        llm = build()
        if warm_up:
            llm.warm_up()
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", ModelInfo.of(llm)))
    # A thread of its own pickles and sends each step's output while the engine thread waits on the device.
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(outbox, conn), name="jax_offload-engine-sender", daemon=True)
    sender.start()
    core = EngineCore(llm, lambda items, load, host_bytes: outbox.put((items, load, host_bytes)))
    stopped = False

    def get(timeout: float | None) -> tuple | None:
        nonlocal stopped
        if timeout is not None and not conn.poll(timeout):
            raise queue.Empty
        command = conn.recv()
        if command[0] == "stop":
            stopped = True
            return None
        return command

    try:
        _drive(core, get, queue.Empty, lambda: stopped)
    finally:
        outbox.put(None)
        sender.join(timeout=30)


def _end_with_parent() -> None:
    """Ends the engine process as soon as the process that started it is gone, whatever the engine is doing: a server
    killed while its engine builds, warms up or runs a long prefill must not leave the engine compiling and holding
    the GPU (it reads its pipe, and would see the parent gone, only between steps)."""
    multiprocessing.parent_process().join()
    os._exit(1)


def _send_all(outbox: queue.SimpleQueue, conn) -> None:
    """Sends the engine's output in order until None; a parent gone ends it. A step's deltas go as tuples of their
    fields: pickling 256 of them took 0.05 ms against 0.85 ms as dataclasses (on a 2-core CPU), time this thread
    holds the GIL while the engine's thread would launch the next step."""
    while (message := outbox.get()) is not None:
        items, load, host_bytes = message
        deltas, others = [], []
        for key, item in items:
            if type(item) is RequestDelta:
                deltas.append((item.request_id, item.token_ids, item.text, item.logprobs, item.finish_reason,
                               item.output))
            else:
                others.append((key, item))
        try:
            conn.send((deltas, others, load, host_bytes))
        except (BrokenPipeError, OSError):
            return


def _drive(core: EngineCore, get: Callable[[float | None], tuple | None], empty: type,
           stopped: Callable[[], bool]) -> None:
    """The engine's loop: take every command that waits, then run a step. `get(timeout)` waits that long for a
    command (None: until one comes; raises `empty` when none came). An idle engine sleeps until a command comes;
    one with a decode step in flight waits for commands until the next step is due (`EngineCore.step_due`), a
    slice at a time to see the step in flight finish early."""
    while not stopped():
        timeout = None
        if core.busy:
            due = core.step_due()
            timeout = 0 if due is None else min(max(due - time.perf_counter(), 0), DUE_POLL_SECONDS)
        commands = []
        try:
            commands.append(get(timeout))
            while True:
                commands.append(get(0))
        except empty:
            pass
        for command in commands:
            if command is not None:  # None only wakes the loop (stop)
                core.take(command)
        if stopped():
            return
        if commands or core.step_due() is None:
            core.run_once()


def prompt_logprobs(logits: np.ndarray, ids: list[int], num_logprobs: int) -> list[TokenLogprobs | None]:
    """From prefill logits [n, vocab] (float32): token i's log-probability under position i-1's distribution, with
    its `num_logprobs` most likely tokens (equal log-probabilities: the lower token id first)."""
    logp = logits.astype(np.float64)
    logp = logp - logp.max(axis=-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(axis=-1, keepdims=True))
    vocab = logp.shape[-1]
    k = min(num_logprobs, vocab)
    # Each row's k-th largest value, found without sorting the vocabulary: a stable sort of every prompt position
    # took 0.41 s for 60 positions of a 49,152-token vocabulary on the 2-core CPU, this 0.06 s.
    kth = np.partition(logp[:len(ids) - 1], vocab - k, axis=-1)[:, vocab - k] if k else None
    out: list[TokenLogprobs | None] = [None]
    for i in range(1, len(ids)):
        row = logp[i - 1]
        top = np.zeros(0, np.int64)
        if k:
            candidates = np.flatnonzero(row >= kth[i - 1])  # ascending ids, so a stable sort keeps ties in id order
            top = candidates[np.argsort(-row[candidates], kind="stable")[:k]]
        out.append(TokenLogprobs(float(row[ids[i]]), [(int(t), float(row[t])) for t in top]))
    return out


class _Sink:
    """A handler's asyncio queue, filled from another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue):
        self.loop, self.items = loop, items


def _put_all(pairs: list[tuple[_Sink, object]]) -> None:
    for sink, item in pairs:
        sink.items.put_nowait(item)
