"""OpenAI's request bodies for the server (pydantic), with vLLM's extras, and their checks. What a request asks for
that the engine does not do is refused here, by name, never dropped silently."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jax_offload.sampling import MAX_LOGPROBS


class BadRequest(ValueError):
    """A request the server refuses with a 4xx and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat share (OpenAI's defaults, vLLM's extras)."""

    # Fields OpenAI clients may send that change nothing here (user, metadata, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int = -1
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False

    def check_common(self) -> None:
        if self.n != 1:
            raise BadRequest(f"n must be 1 (one choice per prompt), got {self.n}.", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported; send 0 or leave it out.", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported; leave it out.", "logit_bias")
        if self.temperature is not None and self.temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {self.temperature}.", "temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k != -1 and self.top_k < 1:
            raise BadRequest(f"top_k must be -1 (off) or >= 1, got {self.top_k}.", "top_k")
        if self.min_tokens < 0:
            raise BadRequest(f"min_tokens must be >= 0, got {self.min_tokens}.", "min_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(not s for s in stops):
            raise BadRequest("stop strings must not be empty.", "stop")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.best_of not in (None, 1):
            raise BadRequest(f"best_of must be 1, got {self.best_of}.", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported; leave it out.", "suffix")
        if self.max_tokens is not None and (self.max_tokens < 0 or (self.max_tokens == 0 and not self.echo)):
            raise BadRequest(f"max_tokens must be >= 1 (0 only with echo), got {self.max_tokens}.", "max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.", "logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt must not be empty.", "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a list of content parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"Only text content parts are supported, got {part.get('type')!r}.", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        self.check_common()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is not None and limit < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {limit}.", "max_tokens")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.",
                             "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true.", "top_logprobs")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
