"""An attention state partway through the keys, and how states combine.

`AttentionState(acc, m, l)` is a float32 online softmax over the keys seen so far, in the base-2 units the
kernels compute in: with s_j = q . k_j * sm_scale * log2(e), m is the running max of s_j,
l = sum_j 2^(s_j - m) and acc = sum_j 2^(s_j - m) v_j. The kernels continue such a state key tile by key
tile (`attention_state`, `attention_state_xla`), so attention over keys streamed in ascending blocks ends in
the bits of one call over all of them; kernels that only return (o, lse) fold their result in with
`merge_into_state`. Layouts follow the kernels: acc [B, T, H, D], m and l [B, H, T]. `finish_state` gives
(o, lse); a row that saw no key gets o = 0 and lse = -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import LN2, LOG2E, NEG_INF


class AttentionState(NamedTuple):
    acc: jax.Array  # [B, T, H, D] float32
    m: jax.Array  # [B, H, T] float32, base-2 units
    l: jax.Array  # [B, H, T] float32


def empty_state(batch: int, tq: int, hq: int, head_dim: int) -> AttentionState:
    """The state of rows that have seen no key."""
    return AttentionState(
        jnp.zeros((batch, tq, hq, head_dim), jnp.float32),
        jnp.full((batch, hq, tq), NEG_INF, jnp.float32),
        jnp.zeros((batch, hq, tq), jnp.float32),
    )


def check_state(state: AttentionState, batch: int, tq: int, hq: int, head_dim: int) -> None:
    want = ((batch, tq, hq, head_dim), (batch, hq, tq), (batch, hq, tq))
    got = tuple(tuple(x.shape) for x in state)
    if got != want or any(x.dtype != jnp.float32 for x in state):
        raise ValueError(f"state has shapes {got} and dtypes {[str(x.dtype) for x in state]}; allowed: {want}, float32")


def by_kv_heads(state: AttentionState, hkv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode state (one query token a row) as the decode kernels tile it: acc [B, Hkv, G, D], m and l
    [B, Hkv, G, 1], G = H / Hkv query heads a KV head."""
    batch, _, hq, d = state.acc.shape
    group = hq // hkv
    return (state.acc.reshape(batch, hkv, group, d), state.m.reshape(batch, hkv, group, 1),
            state.l.reshape(batch, hkv, group, 1))


def from_kv_heads(acc: jax.Array, m: jax.Array, l: jax.Array) -> AttentionState:
    """`by_kv_heads`' tiles back to a decode state."""
    batch, hkv, group, d = acc.shape
    hq = hkv * group
    return AttentionState(acc.reshape(batch, 1, hq, d), m.reshape(batch, hq, 1), l.reshape(batch, hq, 1))


def _rows_first(x: jax.Array) -> jax.Array:
    """[B, H, T] -> [B, T, H, 1], to scale acc."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def merge_into_state(state: AttentionState, o: jax.Array, lse: jax.Array) -> AttentionState:
    """Folds the result (o [B, T, H, D], natural-log lse [B, H, T]) of attention over further keys into `state`."""
    lse2 = lse * LOG2E
    m = jnp.maximum(state.m, lse2)
    m_use = jnp.where(m == NEG_INF, 0.0, m)  # both empty: keep exp2() finite
    w_old, w_new = jnp.exp2(state.m - m_use), jnp.exp2(lse2 - m_use)
    part = jnp.where(_rows_first(w_new) > 0, _rows_first(w_new) * o.astype(jnp.float32), 0.0)
    return AttentionState(state.acc * _rows_first(w_old) + part, m, state.l * w_old + w_new)


def finish_state(state: AttentionState) -> tuple[jax.Array, jax.Array]:
    """-> (o float32 [B, T, H, D], natural-log lse [B, H, T])."""
    seen = state.l > 0.0
    l_safe = jnp.where(seen, state.l, 1.0)
    lse = jnp.where(seen, (state.m + jnp.log2(l_safe)) * LN2, NEG_INF)
    return state.acc / _rows_first(l_safe), lse  # unseen rows have acc = 0, so o = 0
