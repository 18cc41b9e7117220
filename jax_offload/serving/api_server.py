"""The OpenAI-compatible HTTP API (FastAPI) over an `EngineLoop`: completions, chat completions, models, health,
metrics, tokenize and detokenize. Handlers check and tokenize requests and format answers; the engine thread does
the rest."""
from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import lru_cache

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jax_offload.outputs import RequestDelta
from jax_offload.sampling import SamplingParams, TokenLogprobs
from jax_offload.engine import chat_ids
from jax_offload.serving.async_engine import EngineFailure, EngineLoop, EngineProcess, ModelInfo
from jax_offload.serving.metrics import ServerMetrics
from jax_offload.serving.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          TokenizeRequest)


def freeze_startup_heap() -> None:
    """Moves every object alive now (imports, the app, the engine's front) out of the garbage collector's sight, as
    vLLM does after its warm-up, so that a full collection walks only what serving made. The HTTP process calls it
    before it serves: unfrozen, its full collections (~200,000 objects) stopped the event loop for 0.20-0.45 s of
    each infinite-rate run on an H200, against 0.02-0.04 s frozen (bench/results/runs/h200_serve). The engine
    process made no full collection over 256 requests."""
    gc.collect()
    gc.freeze()


@contextmanager
def serve_in_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                        timeout: float = 120.0) -> Iterator[tuple[str, threading.Thread]]:
    """Serves `app` with uvicorn on a thread of this process (a notebook, a test, a benchmark) until the block ends:
    (its base URL, the thread running its event loop). Port 0: a free one."""
    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="jax_offload-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"The server on {host}:{port} did not start within {timeout:g} s.")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}", thread
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def create_app(engine, served_model_name: str, api_key: str | None = None, max_waiting: int = 1024,
               warm_up: bool = False) -> FastAPI:
    """The app serving as `served_model_name` an `EngineProcess` (the engine in its own process, the server's
    way), an `EngineLoop`, or an `LLM` (run by an `EngineLoop` on a thread of this process). With `api_key`, /v1
    requests need `Authorization: Bearer KEY`; more than `max_waiting` requests waiting for their first token
    get 503 (back-pressure). `warm_up`: compile the engine's steps before serving (`LLM.warm_up`)."""
    metrics = ServerMetrics()
    if not isinstance(engine, (EngineLoop, EngineProcess)):
        engine = EngineLoop(engine)
    engine.observe = metrics.observe
    api = _Api(engine, metrics, served_model_name, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(warm_up)
        yield
        engine.stop()

    app = FastAPI(title="jax_offload", lifespan=lifespan)
    app.state.engine = engine

    if api_key:
        app.add_middleware(_RequireKey, key=api_key)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(BadRequest("The body is not valid JSON."))
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return _error(BadRequest(f"{where or 'body'}: {first.get('msg')}", where))

    @app.exception_handler(EngineFailure)
    async def failed(request: Request, error: EngineFailure):
        return _error(BadRequest(str(error), None, 500, "internal_error"))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": api.started,
                                            "owned_by": "jax_offload", "root": served_model_name,
                                            "max_model_len": api.info.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        api.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("Give either prompt or messages.", "prompt")
        ids = api.chat_ids(body.messages) if body.messages is not None else api.text_ids(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": api.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        api.check_model(body.model)
        return {"prompt": api.decode(api.token_ids(body.tokens, "tokens"))}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat(body, request)

    return app


# How often a handler waiting for the engine looks whether its client is gone.
DISCONNECT_POLL_SECONDS = 0.5


class _Api:
    def __init__(self, engine: EngineLoop | EngineProcess, metrics: ServerMetrics, name: str, max_waiting: int):
        self.engine, self.metrics, self.name, self.max_waiting = engine, metrics, name, max_waiting
        self.started = int(time.time())
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    @property
    def tokenizer(self):
        return self.engine.info.tokenizer

    # ---- inputs -----------------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise BadRequest(f"The model {model!r} does not exist; this server serves {self.name!r}.", "model", 404,
                             "not_found_error")

    def text_ids(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("This server has no tokenizer; send prompts as token ids.", "prompt")
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = self.info.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # builtins first: the comprehension only names the culprit
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise BadRequest(f"Token id {bad} is outside the vocabulary [0, {vocab}).", param)
        return list(ids)

    def chat_ids(self, messages) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRequest("This model has no chat template; use /v1/completions.", "messages")
        return chat_ids(self.tokenizer, [{"role": m.role, "content": m.text()} for m in messages])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"

    def prompts_of(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.text_ids(prompt)]
        if isinstance(prompt[0], int):  # the request model made it a list[int]: no element needs checking
            return [self.token_ids(prompt)]
        return [self.text_ids(p) if isinstance(p, str) else self.token_ids(p) for p in prompt]

    def params(self, body, prompt_len: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; a prompt with max_tokens past max_model_len is refused, naming both."""
        limit = self.info.max_model_len
        if prompt_len == 0:
            raise BadRequest("The prompt is empty; give at least one token.", "prompt")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        if prompt_len + max(max_tokens, 1) > limit:
            raise BadRequest(f"The prompt has {prompt_len} tokens and max_tokens is {max_tokens}: {prompt_len + max_tokens}"
                             f" tokens, more than max_model_len {limit}. Shorten the prompt or lower max_tokens.",
                             "max_tokens")
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, max_tokens=max(max_tokens, 1),
                ignore_eos=body.ignore_eos, seed=body.seed, stop=body.stop, logprobs=logprobs,
                min_tokens=min(body.min_tokens, max(max_tokens, 1)))
        except ValueError as error:
            raise BadRequest(str(error)) from None

    def admit(self, count: int) -> None:
        if self.engine.num_waiting + count > self.max_waiting:
            raise BadRequest(f"The server is overloaded: {self.engine.num_waiting} requests wait for their first "
                             f"token (--max-waiting {self.max_waiting}); retry later.", None, 503, "server_overloaded")

    # ---- running ----------------------------------------------------------------------------------------------

    async def deltas(self, request_id: str, jobs: list[tuple[list[int], SamplingParams]]
                     ) -> AsyncIterator[tuple[int, list[RequestDelta]]]:
        """(prompt index, the deltas that have come) of every job, as the engine makes them; leaving early aborts
        those unfinished."""
        for i, (ids, _) in enumerate(jobs):
            self.metrics.arrived(f"{request_id}-{i}", len(ids))
        if len(jobs) == 1:
            try:
                async for batch in self.engine.generate(f"{request_id}-0", *jobs[0]):
                    yield 0, batch
            finally:
                self.metrics.left(f"{request_id}-0")
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def run(i: int, ids: list[int], params: SamplingParams) -> None:
            try:
                async for batch in self.engine.generate(f"{request_id}-{i}", ids, params):
                    await merged.put((i, batch))
            except Exception as error:  # noqa: BLE001 - handed to the consumer
                await merged.put((i, error))

        tasks = [asyncio.ensure_future(run(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
        try:
            done = 0
            while done < len(jobs):
                i, item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                done += item[-1].finished
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for i in range(len(jobs)):
                self.metrics.left(f"{request_id}-{i}")

    async def collect(self, request: Request, request_id: str, jobs) -> list[list[RequestDelta]]:
        """Every delta of every job; a client gone before the end aborts them."""
        per_job: list[list[RequestDelta]] = [[] for _ in jobs]

        async def gather() -> None:
            async for i, batch in self.deltas(request_id, jobs):
                per_job[i] += batch

        task = asyncio.ensure_future(gather())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return per_job
        task.result()
        return per_job

    # ---- /v1/completions --------------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        body.check()
        self.check_model(body.model)
        prompts = self.prompts_of(body.prompt)
        jobs = [(ids, self.params(body, len(ids), body.max_tokens, body.logprobs)) for ids in prompts]
        generating = body.max_tokens != 0
        self.admit(len(jobs) if generating else 0)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echoed = [await self.echo(request_id, ids, body) for ids in prompts] if body.echo else None
        if body.stream:
            return await _sse(self.stream_completion(request_id, body, jobs if generating else [], echoed))
        per_job = await self.collect(request, request_id, jobs) if generating else [[] for _ in jobs]
        choices = []
        usage = {"prompt_tokens": sum(len(ids) for ids in prompts), "completion_tokens": 0}
        for i, deltas in enumerate(per_job):
            ids = [t for d in deltas for t in d.token_ids]
            lps = [lp for d in deltas for lp in d.logprobs]
            text = "".join(d.text for d in deltas)
            usage["completion_tokens"] += len(ids)
            logprobs = None
            if body.logprobs is not None:
                head_ids, head_lps, head_text = echoed[i] if echoed else ([], [], "")
                logprobs = self.completion_logprobs(head_ids + ids, head_lps + lps, body.logprobs)
            choice = {"index": i, "text": (echoed[i][2] if echoed else "") + text, "logprobs": logprobs,
                      "finish_reason": deltas[-1].finish_reason if deltas else "length"}
            if body.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": usage}

    async def echo(self, request_id: str, ids: list[int], body: CompletionRequest):
        """(ids, log-probabilities, text) of an echoed prompt; the log-probabilities only when asked."""
        lps = await self.engine.prompt_logprobs(f"{request_id}-echo", ids, body.logprobs) \
            if body.logprobs is not None else [None] * len(ids)
        return ids, lps, self.decode(ids)

    async def stream_completion(self, request_id: str, body: CompletionRequest, jobs, echoed):
        created, usage = int(time.time()), {"prompt_tokens": 0, "completion_tokens": 0}

        def chunk(choices: list[dict]) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": self.name,
                    "choices": choices, **({"usage": None} if _usage_asked(body) else {})}

        try:
            for i, (ids, lps, text) in enumerate(echoed or []):
                usage["prompt_tokens"] += len(ids)
                logprobs = self.completion_logprobs(ids, lps, body.logprobs) if body.logprobs is not None else None
                yield chunk([{"index": i, "text": text, "logprobs": logprobs,
                              "finish_reason": None if jobs else "length"}])
            if not echoed:
                usage["prompt_tokens"] = sum(len(ids) for ids, _ in jobs)
            offsets = [len(e[2]) for e in echoed] if echoed else [0] * len(jobs)
            async for i, batch in self.deltas(request_id, jobs):
                chunks = []
                for delta in batch:
                    usage["completion_tokens"] += len(delta.token_ids)
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self.completion_logprobs(delta.token_ids, delta.logprobs, body.logprobs,
                                                            offsets[i])
                    offsets[i] += len(delta.text)
                    choice = {"index": i, "text": delta.text, "logprobs": logprobs,
                              "finish_reason": delta.finish_reason}
                    if body.return_token_ids:
                        choice["token_ids"] = delta.token_ids
                    chunks.append(chunk([choice]))
                yield chunks
            if _usage_asked(body):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield {**chunk([]), "usage": usage}
        except (BadRequest, EngineFailure) as error:
            yield (error if isinstance(error, BadRequest) else BadRequest(str(error), None, 500, "internal_error")
                   ).body()

    def completion_logprobs(self, ids: list[int], lps: list[TokenLogprobs | None], n: int, offset: int = 0
                            ) -> dict:
        """OpenAI's completions `logprobs` object: each token's text, log-probability, the n likeliest (with the
        token itself, as vLLM) and its text offset."""
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = []
        for token, lp in zip(ids, lps):
            if lp is None:
                top.append(None)
                continue
            entries = {self.token_text(t): v for t, v in lp.top[:n]}
            entries.setdefault(self.token_text(token), lp.logprob)
            top.append(entries)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": top, "text_offset": offsets}

    # ---- /v1/chat/completions ---------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request):
        body.check()
        self.check_model(body.model)
        ids = self.chat_ids(body.messages)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        jobs = [(ids, self.params(body, len(ids), body.token_limit, num_logprobs))]
        self.admit(1)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await _sse(self.stream_chat(request_id, body, jobs))
        (deltas,) = await self.collect(request, request_id, jobs)
        lps = [lp for d in deltas for lp in d.logprobs]
        tokens = [t for d in deltas for t in d.token_ids]
        completion = len(tokens)
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                  "logprobs": self.chat_logprobs(tokens, lps, body.top_logprobs or 0) if body.logprobs else None,
                  "finish_reason": deltas[-1].finish_reason if deltas else "length"}
        if body.return_token_ids:
            choice["token_ids"] = tokens
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.name,
                "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                                               "total_tokens": len(ids) + completion}}

    async def stream_chat(self, request_id: str, body: ChatCompletionRequest, jobs):
        created = int(time.time())

        def chunk(choices: list[dict]) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.name,
                    "choices": choices, **({"usage": None} if _usage_asked(body) else {})}

        completion = 0
        # The role goes out with the first tokens: the request reaches the engine before anything is sent (`_sse`).
        role = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}])]
        try:
            async for _, batch in self.deltas(request_id, jobs):
                chunks, role = role, []
                for delta in batch:
                    completion += len(delta.token_ids)
                    choice = {"index": 0, "delta": {"content": delta.text} if delta.text else {},
                              "logprobs": self.chat_logprobs(delta.token_ids, delta.logprobs, body.top_logprobs or 0)
                              if body.logprobs else None, "finish_reason": delta.finish_reason}
                    if body.return_token_ids:
                        choice["token_ids"] = delta.token_ids
                    chunks.append(chunk([choice]))
                yield chunks
            if _usage_asked(body):
                prompt = len(jobs[0][0])
                yield {**chunk([]), "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                              "total_tokens": prompt + completion}}
        except (BadRequest, EngineFailure) as error:
            yield (error if isinstance(error, BadRequest) else BadRequest(str(error), None, 500, "internal_error")
                   ).body()

    def chat_logprobs(self, ids: list[int], lps: list[TokenLogprobs], n: int) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top[:n]]}
                            for t, lp in zip(ids, lps)]}


class _RequireKey:
    """/v1 requests need `Authorization: Bearer KEY`. Plain ASGI: Starlette's `BaseHTTPMiddleware` passes every
    streamed chunk through memory streams, which cost more than the rest of the server's work per token."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            response = _error(BadRequest("A valid API key is needed: send 'Authorization: Bearer KEY'.", None, 401,
                                         "authentication_error"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _usage_asked(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _sse(chunks: AsyncIterator[dict | list[dict]]) -> StreamingResponse:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`; the chunks of one list (the tokens
    that came while the event loop was busy) go out in one write. The stream is started here, as far as its first
    wait, before the response is: the request reaches the engine while its handler runs, and the response's headers
    and tasks are set up while the engine works (set up first, they held the request back 0.3 ms on the 2-core
    CPU machine). A client gone mid-stream cancels the generator, whose cleanup aborts the request."""

    async def events():
        async for item in chunks:
            yield "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in (item if isinstance(item, list) else [item]))
        yield "data: [DONE]\n\n"

    async def then(first: asyncio.Future, rest: AsyncIterator[str]):
        yield await first
        async for event in rest:
            yield event

    stream = events()
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # the stream runs to its first wait: the engine has the request
    return StreamingResponse(then(first, stream), media_type="text/event-stream")


def _error(error: BadRequest) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)
