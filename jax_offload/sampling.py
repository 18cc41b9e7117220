"""Sampling parameters and the jit-compiled next-token sampler."""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.precision import step_jit


# The most alternatives a token's log-probabilities list (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k -1 and top_p 1 switch those filters off.
    `logprobs` N: each drawn token comes with its log-probability and the N likeliest tokens' (of the model's
    distribution before temperature and filters, as vLLM's). `min_tokens`: EOS cannot be drawn, and stop strings
    do not end the request, before that many tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _integer(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}.")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.logprobs is not None and (not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}.")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}.")
        if self.seed is not None and not _integer(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}.")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclasses.dataclass(slots=True)
class TokenLogprobs:
    """A drawn token's natural-log probability and the likeliest tokens' (id, log-probability), best first."""

    logprob: float
    top: list[tuple[int, float]]


class Drawn(NamedTuple):
    """What a step draws for each row: token ids [B], and when some row asks for them, (the drawn token's
    log-probability [B], the MAX_LOGPROBS likeliest ids [B, N] and their log-probabilities [B, N])."""

    tokens: jax.Array
    logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None


def drawn_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`Drawn.logprobs` of tokens [B] drawn from float32 logits [B, vocab]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp


def drawn_to_host(drawn: Drawn, n: int) -> list[tuple[int, TokenLogprobs | None]]:
    """The first n rows of a step's draw, read from the device: (token, its log-probabilities or None)."""
    tokens = np.asarray(drawn.tokens)[:n].tolist()
    if drawn.logprobs is None:
        return [(t, None) for t in tokens]
    lp, ids, top = (np.asarray(a)[:n] for a in drawn.logprobs)
    return [(t, TokenLogprobs(float(lp[i]), list(zip(ids[i].tolist(), top[i].tolist()))))
            for i, t in enumerate(tokens)]


def request_key(seed: int) -> np.ndarray:
    """`jax.random.PRNGKey(seed)` (threefry, 32-bit: [0, seed mod 2**32]) made on the host: a key made on the
    device would wait behind the decode steps in flight when a request comes."""
    return np.array([0, seed % 2**32], np.uint32)


def _finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@step_jit
def sample_token(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, key: jax.Array
) -> jax.Array:
    """Picks one token id from float32 `logits` [vocab]; the knobs are traced so changing them never recompiles."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    descending = jnp.sort(scaled)[::-1]
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = descending[k - 1]
    descending = jnp.where(descending >= kth_value, descending, -jnp.inf)
    # Nucleus: keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    cumulative = jnp.cumsum(jax.nn.softmax(descending))
    cut = jnp.minimum(jnp.sum(cumulative < top_p), vocab - 1)
    threshold = jnp.maximum(descending[cut], kth_value)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
