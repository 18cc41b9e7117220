"""`EngineLoop`: one thread owns the `LLM` and makes every JAX call; the server's handlers (on the asyncio event
loop) talk to it through queues. A request added while others decode joins the running batch at the next step."""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable

import numpy as np

from jax_offload.outputs import RequestDelta
from jax_offload.sampling import SamplingParams, TokenLogprobs
from jax_offload.serving.engine import StepFailed
from jax_offload.serving.protocol import BadRequest

class EngineFailure(RuntimeError):
    """The engine failed while running a request (the server answers 500 and goes on)."""


@dataclasses.dataclass
class _Request:
    request_id: str
    sink: _Sink  # the handler's queue
    prompt_ids: list[int]
    params: SamplingParams | None  # None: a prompt-logprobs job
    num_logprobs: int = 0


class EngineLoop:
    """Runs `llm` on a thread of its own. `generate` streams a request's deltas; `prompt_logprobs` scores a prompt
    (for `echo`); `abort` drops a request (a client gone). `on_step(llm, deltas)` runs on the engine thread after
    every step (the metrics)."""

    def __init__(self, llm, on_step: Callable[[object, list[RequestDelta]], None] | None = None):
        self.llm = llm
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._scores: deque[_Request] = deque()
        self._waiting = 0  # requests added whose first token has not come: the back-pressure count
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jax_offload-engine", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._waiting

    # ---- the handlers' side (event loop) ---------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[list[RequestDelta]]:
        """The request's deltas as steps produce them, each time all that have come (a busy event loop then
        writes several tokens at once); the last has `output`. Leaving early aborts the request."""
        items, sink = _channel()
        with self._lock:
            self._waiting += 1
        self._commands.put(_Request(request_id, sink, prompt_ids, params))
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
                    self._left_waiting()
                finished = batch[-1].finished
                yield batch
        finally:
            if not first:
                self._left_waiting()
            if not finished:
                self._commands.put(("abort", request_id))

    async def prompt_logprobs(self, request_id: str, prompt_ids: list[int], num_logprobs: int
                              ) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability given the tokens before it (None for the first), with the
        `num_logprobs` likeliest tokens at each position."""
        items, sink = _channel()
        self._commands.put(_Request(request_id, sink, prompt_ids, None, num_logprobs))
        item = await items.get()
        if isinstance(item, Exception):
            raise item
        return item

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def _left_waiting(self) -> None:
        with self._lock:
            self._waiting -= 1

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not (self.llm.has_unfinished() or self._scores)
            commands = [self._commands.get()] if idle else []  # an idle engine sleeps until a command comes
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is not None:  # None only wakes the thread (stop)
                    self._take(command)
            if self._stop.is_set():
                return
            self._score_when_free()
            if self.llm.has_unfinished():
                self._step()

    def _take(self, command) -> None:
        if isinstance(command, tuple):  # ("abort", request_id)
            self.llm.abort(command[1])
            self._sinks.pop(command[1], None)
            self._scores = deque(r for r in self._scores if r.request_id != command[1])
            return
        if command.params is None:
            self._scores.append(command)
            return
        try:
            self.llm.add_request(command.request_id, command.prompt_ids, command.params)
        except ValueError as error:
            command.sink(BadRequest(str(error)))
            return
        self._sinks[command.request_id] = command.sink

    def _score_when_free(self) -> None:
        """Scores waiting prompts: at once in GPU memory; offloaded only while no request runs, since the
        one-request prefill it takes writes over the host store the running requests share."""
        while self._scores and not (self.llm.engine_config.offload and self.llm.has_unfinished()):
            job = self._scores.popleft()
            try:
                job.sink(prompt_logprobs(self.llm.logits(job.prompt_ids), job.prompt_ids, job.num_logprobs))
            except ValueError as error:
                job.sink(BadRequest(str(error)))
            except Exception as error:  # noqa: BLE001 - the server answers 500 and goes on
                job.sink(EngineFailure(f"Scoring the prompt failed: {type(error).__name__}: {error}"))

    def _step(self) -> None:
        try:
            deltas = self.llm.step()
        except StepFailed as failed:
            for rid in failed.request_ids:
                sink = self._sinks.pop(rid, None)
                if sink is not None:
                    sink(EngineFailure(str(failed)))
            return
        except Exception as error:  # noqa: BLE001 - a step that fails outside the engine's guard fails everyone
            for rid, sink in list(self._sinks.items()):
                self.llm.abort(rid)
                sink(EngineFailure(f"The engine failed: {type(error).__name__}: {error}"))
            self._sinks.clear()
            return
        self.steps += 1
        handed: list[tuple[_Sink, RequestDelta]] = []
        for delta in deltas:
            sink = self._sinks.get(delta.request_id)
            if sink is not None:
                handed.append((sink, delta))
                if delta.finished:
                    del self._sinks[delta.request_id]
        _hand_over(handed)
        if self.on_step is not None:
            self.on_step(self.llm, deltas)


def prompt_logprobs(logits: np.ndarray, ids: list[int], num_logprobs: int) -> list[TokenLogprobs | None]:
    """From prefill logits [n, vocab] (float32): token i's log-probability under position i-1's distribution."""
    logp = logits.astype(np.float64)
    logp = logp - logp.max(axis=-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(axis=-1, keepdims=True))
    out: list[TokenLogprobs | None] = [None]
    for i in range(1, len(ids)):
        row = logp[i - 1]
        top = np.argsort(-row, kind="stable")[:num_logprobs] if num_logprobs else np.zeros(0, np.int64)
        out.append(TokenLogprobs(float(row[ids[i]]), [(int(t), float(row[t])) for t in top]))
    return out


class _Sink:
    """A handler's asyncio queue, filled from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue):
        self.loop, self.items = loop, items

    def __call__(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)


def _hand_over(handed: list[tuple[_Sink, object]]) -> None:
    """Puts a step's items into their queues with one wake-up of each event loop, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, object]]] = {}
    for sink, item in handed:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, pairs in by_loop.items():
        loop.call_soon_threadsafe(_put_all, pairs)


def _put_all(pairs: list[tuple[_Sink, object]]) -> None:
    for sink, item in pairs:
        sink.items.put_nowait(item)


def _channel() -> tuple[asyncio.Queue, _Sink]:
    """An asyncio queue of the running loop and the sink that puts into it from any thread."""
    items: asyncio.Queue = asyncio.Queue()
    return items, _Sink(asyncio.get_running_loop(), items)
