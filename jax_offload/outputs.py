"""What a request gives back: each step's delta, and the whole output once it finishes."""
from __future__ import annotations

import dataclasses

from jax_offload.sampling import TokenLogprobs


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "abort"
    prefill_seconds: float
    decode_seconds: float
    decode_token_seconds: list[float] = dataclasses.field(default_factory=list)  # each decode step's wall time
    # XAttention prefill: per layer, the selected share of the causally visible (query, key) blocks, all heads.
    prefill_density: list[float] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused from the prefix cache (vLLM's name)
    logprobs: list[TokenLogprobs] | None = None  # one per token, with SamplingParams.logprobs
    request_id: str = ""

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_token_ids) / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes out of prefill; decode makes the rest.
        return max(len(self.token_ids) - 1, 0) / max(self.decode_seconds, 1e-9)


@dataclasses.dataclass(slots=True)  # slots: a server's engine process pickles a step's deltas, its front unpickles
class RequestDelta:
    """What one engine step added to a request: its new tokens (none when EOS ended it), the text they add, their
    log-probabilities if asked; on the request's last delta its finish reason and whole output."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
