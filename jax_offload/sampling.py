"""Sampling parameters and the jit-compiled next-token sampler."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_offload.precision import step_jit


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k -1 and top_p 1 switch those filters off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None

    def __post_init__(self) -> None:
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _integer(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}.")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
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
