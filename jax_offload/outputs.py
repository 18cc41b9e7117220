"""What a finished request gives back, and where its text stops."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prefill_seconds: float
    decode_seconds: float
    decode_token_seconds: list[float] = dataclasses.field(default_factory=list)  # each decode step's wall time
    # XAttention prefill: per layer, the selected share of the causally visible (query, key) blocks, all heads.
    prefill_density: list[float] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused from the prefix cache (vLLM's name)

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_token_ids) / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes out of prefill; decode makes the rest.
        return max(len(self.token_ids) - 1, 0) / max(self.decode_seconds, 1e-9)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
