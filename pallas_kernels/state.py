"""An attention state partway through the keys, and how states combine.

`AttentionState(acc, m, l)` is a float32 online softmax over the keys seen so far: m is the running max
of the scaled scores (natural-log units), l = sum_j exp(s_j - m) and acc = sum_j exp(s_j - m) v_j.
The jnp twins continue such a state key tile by key tile (`attention_state_xla`), so attention over keys
streamed in blocks ends in exactly the bits of one call over all of them; kernels that return (o, lse)
fold their result in with `merge_into_state`. Layouts follow the kernels: acc [B, T, H, D], m and l
[B, H, T]. `finish_state` gives (o, lse); a row that saw no key gets o = 0 and lse = -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import NEG_INF


class AttentionState(NamedTuple):
    acc: jax.Array  # [B, T, H, D] float32
    m: jax.Array  # [B, H, T] float32
    l: jax.Array  # [B, H, T] float32


def empty_state(batch: int, tq: int, hq: int, head_dim: int) -> AttentionState:
    """The state of rows that have seen no key."""
    return AttentionState(
        jnp.zeros((batch, tq, hq, head_dim), jnp.float32),
        jnp.full((batch, hq, tq), NEG_INF, jnp.float32),
        jnp.zeros((batch, hq, tq), jnp.float32),
    )


def _rows_first(x: jax.Array) -> jax.Array:
    """[B, H, T] -> [B, T, H, 1], to scale acc."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def merge_into_state(state: AttentionState, o: jax.Array, lse: jax.Array) -> AttentionState:
    """Folds the result (o [B, T, H, D], lse [B, H, T]) of attention over further keys into `state`."""
    m = jnp.maximum(state.m, lse)
    m_use = jnp.where(m == NEG_INF, 0.0, m)  # both empty: keep exp() finite
    w_old, w_new = jnp.exp(state.m - m_use), jnp.exp(lse - m_use)
    part = jnp.where(_rows_first(w_new) > 0, _rows_first(w_new) * o.astype(jnp.float32), 0.0)
    return AttentionState(state.acc * _rows_first(w_old) + part, m, state.l * w_old + w_new)


def finish_state(state: AttentionState) -> tuple[jax.Array, jax.Array]:
    """-> (o float32 [B, T, H, D], lse [B, H, T])."""
    seen = state.l > 0.0
    l_safe = jnp.where(seen, state.l, 1.0)
    lse = jnp.where(seen, state.m + jnp.log(l_safe), NEG_INF)
    return state.acc / _rows_first(l_safe), lse  # unseen rows have acc = 0, so o = 0
