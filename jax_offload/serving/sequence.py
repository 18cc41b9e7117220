"""One request's state, as the scheduler, the block manager and the model runner share it."""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jax_offload.sampling import SamplingParams


class PromptKV(NamedTuple):
    """What a one-request runner's prefill of a whole prompt leaves for the pool (`Sequence.own_prefill`)."""

    hidden: object  # the last prompt token's hidden state [1, 1, hidden]
    k: list  # per layer, K [1, cache_len >= prompt, Hkv, D]
    v: list  # per layer, V, the same
    cached_tokens: int = 0  # prompt tokens whose KV came from a store (CacheBlend's segments)
    density: list[float] | None = None  # XAttention: per layer, the share of key blocks its prefill selected


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # needs a prefill (new, or preempted and to be recomputed)
    RUNNING = enum.auto()  # its KV is in the GPU pool
    SWAPPED = enum.auto()  # its KV waits in host memory
    FINISHED = enum.auto()


@dataclasses.dataclass(eq=False)
class Sequence:
    """A prompt and what has been generated for it.

    `num_cached` counts the tokens whose K and V are in the pool (or, while swapped, on the host). A running
    sequence has all but its last token cached: the last one is the input of its next decode step.
    `num_pending` counts tokens already drawn by decode steps in flight whose values the host has not read
    yet (the engine overlaps a step with the bookkeeping of the one before); they count as tokens, and
    `output_ids` holds only the read ones.
    """

    index: int  # position in the caller's list: outputs come back in this order, and lower is older
    prompt_ids: list[int]
    params: SamplingParams
    key: np.ndarray  # uint32 [2], jax.random.PRNGKey(seed); token n is drawn with fold_in(key, n)
    max_len: int  # prompt + max_tokens, capped at max_model_len
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    num_pending: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    host_kv: object = None  # the swapped-out KV blocks (host arrays) while SWAPPED
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "abort"
    request_id: str = ""
    eos_ids: frozenset[int] = frozenset()  # the model's; min_tokens keeps the sampler from drawing them
    detokenizer: object = None  # the request's `Detokenizer`
    logprobs: list = dataclasses.field(default_factory=list)  # a `TokenLogprobs` per read token, if asked
    prefill_seconds: float = 0.0  # the step that gave its first token
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # each decode step it took part in
    prefill_density: list[float] | None = None  # XAttention prefill: per layer, the share of key blocks selected
    # A prompt a one-request runner prefills in a step of its own (CacheBlend `Segments`, XAttention in GPU memory):
    # own_prefill(total_len) -> PromptKV.
    own_prefill: Callable[[int], "PromptKV"] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Tokens drawn so far, pending ones included: the index of the next draw."""
        return len(self.output_ids) + self.num_pending

    @property
    def token_ids(self) -> list[int]:
        if self.num_pending:
            raise RuntimeError(f"Sequence {self.index} has {self.num_pending} tokens not read from the device yet.")
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        if self.num_pending:
            raise RuntimeError(f"Sequence {self.index}'s last token is not read from the device yet.")
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
