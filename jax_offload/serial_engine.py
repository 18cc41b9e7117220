"""`SerialEngine`: requests one after another, each from a fresh KV state, through the per-request runners: what
`LLM.generate` runs for one prompt on the XLA twins, offloaded or with XAttention prefill in GPU memory, without
prefix caching (`LLM._single_prompt_batches`). Its API is the batch engine's; the server and `add_request` always
use the batch engine."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.attention import embed_tokens
from jax_offload.detokenizer import Detokenizer
from jax_offload.outputs import RequestDelta, RequestOutput
from jax_offload.sampling import SamplingParams, TokenLogprobs, drawn_logprobs, request_key, sample_token
from jax_offload.serving.engine import EngineLoad
from jax_offload.tensor_parallel import to_host

class SerialEngine:
    """Runs the oldest request to its end, a token a `step`, then the next. `llm` is the `LLM` whose runner,
    parameters and tokenizer it uses."""

    def __init__(self, llm):
        self.llm = llm
        self.progress = False  # a bar over long prompts' prefill
        self._queue: deque[tuple[str, list[int], SamplingParams]] = deque()
        self._active: tuple[str, Iterator[RequestDelta]] | None = None

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queues a request."""
        if request_id in self._ids():
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self._queue.append((request_id, list(prompt_ids), params))

    def abort(self, request_id: str) -> None:
        if self._active is not None and self._active[0] == request_id:
            self._active[1].close()  # the request's `finally` lets the runner go
            self._active = None
        else:
            self._queue = deque(r for r in self._queue if r[0] != request_id)

    def has_unfinished(self) -> bool:
        return self._active is not None or bool(self._queue)

    def load(self) -> EngineLoad:
        return EngineLoad(int(self._active is not None), len(self._queue))

    def step_due(self) -> float | None:
        """None: nothing is dispatched ahead, so the next step may run at once (`BatchEngine.step_due`)."""
        return None

    def step(self) -> list[RequestDelta]:
        if self._active is None:
            if not self._queue:
                return []
            request_id, ids, params = self._queue.popleft()
            self._active = (request_id, self._run(request_id, ids, params))
        try:
            delta = next(self._active[1])
        except BaseException:
            self._active = None
            raise
        if delta.finished:
            self._active = None
        return [delta]

    def _ids(self) -> set[str]:
        return {r[0] for r in self._queue} | ({self._active[0]} if self._active else set())

    def _run(self, request_id: str, ids: list[int], params: SamplingParams) -> Iterator[RequestDelta]:
        """One request: a delta per drawn token (the first after prefill), the last one with the output."""
        llm = self.llm
        total_len = min(len(ids) + params.max_tokens, llm.max_model_len)
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % (2**31))
        key = jnp.asarray(request_key(seed))
        knobs = (jnp.float32(params.temperature), jnp.float32(params.top_p), np.int32(params.top_k))
        detokenizer = Detokenizer(llm.tokenizer, params.stop_strings)
        banned = np.asarray(sorted(llm.eos_token_ids), np.int32)
        generated: list[int] = []
        logprobs: list[TokenLogprobs] = []
        step_seconds: list[float] = []
        finish_reason = None
        try:
            start = time.perf_counter()
            hidden, first_position = llm._prefill(ids, total_len, self.progress)
            row = np.int32(len(ids) - 1 - first_position)
            prefill_s = decode_start = step_start = None
            position = len(ids)
            while True:
                early = len(generated) < params.min_tokens
                token, token_logprobs = _draw(llm, hidden, row, knobs, jax.random.fold_in(key, len(generated)),
                                              banned if early else None, params.logprobs is not None)
                now = time.perf_counter()
                if prefill_s is None:
                    prefill_s, decode_start = now - start, now
                else:
                    step_seconds.append(now - step_start)
                step_start = now
                if token in llm.eos_token_ids and not params.ignore_eos and not early:
                    finish_reason = "stop"
                    delta = RequestDelta(request_id, [], "", [])
                else:
                    generated.append(token)
                    if token_logprobs is not None:
                        logprobs.append(token_logprobs)
                    text, stopped = detokenizer.add(token, check_stops=not early)
                    finish_reason = "stop" if stopped else "length" if len(ids) + len(generated) >= total_len \
                        else None
                    delta = RequestDelta(request_id, [token], text, [token_logprobs] if token_logprobs else [])
                if finish_reason is not None:
                    delta.finish_reason = finish_reason
                    delta.output = RequestOutput(
                        ids, detokenizer.text, generated, finish_reason, prefill_s, time.perf_counter() - decode_start,
                        step_seconds, llm._prefill_density(),
                        logprobs=logprobs if params.logprobs is not None else None, request_id=request_id)
                    yield delta
                    return
                yield delta
                x = embed_tokens(llm.params.embed, np.full((1, 1), token, np.int32))
                hidden = llm._runner.decode(x, position)
                row = np.int32(0)
                position += 1
        finally:
            llm._runner.finish()


def _draw(llm, hidden: jax.Array, row: np.int32, knobs, key: jax.Array, banned: np.ndarray | None,
          with_logprobs: bool) -> tuple[int, TokenLogprobs | None]:
    logits = llm._last_logits(hidden, row)
    masked = logits if banned is None else logits.at[banned].set(-jnp.inf)
    token = sample_token(masked, *knobs, key)
    if not with_logprobs:
        return int(to_host(token)), None
    lp, ids, top = (to_host(a)[0] for a in drawn_logprobs(logits[None], token[None]))
    return int(to_host(token)), TokenLogprobs(float(lp), list(zip(ids.tolist(), top.tolist())))
