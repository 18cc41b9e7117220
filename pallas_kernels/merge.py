"""Merging attention states (o, lse) computed over disjoint key sets.

m = max(l1, l2), w_i = exp(l_i - m), o = (w1 o1 + w2 o2) / (w1 + w2), l = m + log(w1 + w2);
N-way is the same with the max over all states. Rows whose states are all empty
(lse = -inf) give o = 0 and lse = -inf without NaN, and an empty state's o is ignored even
if it holds garbage.

Layouts (as returned by the attention kernels):
  prefill: o [B, T, H, D] with lse [B, H, T]
  decode:  o [B, H, D]    with lse [B, H]
The merged o is always float32, so a long chain of merges never rounds to the model dtype;
cast once at the end.

Plain jnp on purpose: a merge is elementwise and memory-bound (read each o once, write one o).
XLA fuses the whole formula into one pass over the data, which is what a Pallas kernel could
at best do, and the fusion also absorbs the dtype conversion and the lse transpose.
bench/bench_kernels.py reports its achieved bandwidth against the device copy bandwidth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import NEG_INF


def _lse_to_o_layout(o: jax.Array, lse: jax.Array, name: str) -> jax.Array:
    """Return lse laid out like o.shape[:-1] (a transpose for the prefill layout)."""
    if o.ndim == 4:
        b, t, h, _ = o.shape
        if lse.shape != (b, h, t):
            raise ValueError(
                f"{name} has shape {lse.shape} for o of shape {o.shape}; allowed: {(b, h, t)}")
        return jnp.swapaxes(lse, 1, 2)
    if o.ndim == 3:
        if lse.shape != o.shape[:2]:
            raise ValueError(
                f"{name} has shape {lse.shape} for o of shape {o.shape}; allowed: {o.shape[:2]}")
        return lse
    raise ValueError(f"o has shape {o.shape}; allowed: [B, T, H, D] or [B, H, D]")


def _finish(weighted_sum, total, m_safe):
    seen = total > 0.0
    o = weighted_sum / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, total, 1.0)), NEG_INF)
    return o, lse


@jax.jit
def merge_states(o1: jax.Array, lse1: jax.Array, o2: jax.Array,
                 lse2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge two attention states over disjoint keys; returns (o float32, lse float32)."""
    if o1.shape != o2.shape:
        raise ValueError(f"o1 has shape {o1.shape} and o2 {o2.shape}; allowed: equal shapes")
    l1 = _lse_to_o_layout(o1, lse1, "lse1").astype(jnp.float32)
    l2 = _lse_to_o_layout(o2, lse2, "lse2").astype(jnp.float32)
    m = jnp.maximum(l1, l2)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    w1 = jnp.exp(l1 - m_safe)
    w2 = jnp.exp(l2 - m_safe)
    part1 = jnp.where(w1[..., None] > 0, w1[..., None] * o1.astype(jnp.float32), 0.0)
    part2 = jnp.where(w2[..., None] > 0, w2[..., None] * o2.astype(jnp.float32), 0.0)
    o, lse = _finish(part1 + part2, w1 + w2, m_safe)
    return o, (jnp.swapaxes(lse, 1, 2) if o1.ndim == 4 else lse)


def merge_stack(o_stack: jax.Array, lse_stack: jax.Array) -> tuple[jax.Array, jax.Array]:
    """N-way merge where lse_stack [N, ...] already matches o_stack [N, ..., D] minus D."""
    lse = lse_stack.astype(jnp.float32)
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    w = jnp.exp(lse - m_safe)
    parts = jnp.where(w[..., None] > 0, w[..., None] * o_stack.astype(jnp.float32), 0.0)
    return _finish(jnp.sum(parts, axis=0), jnp.sum(w, axis=0), m_safe)


@jax.jit
def merge_states_n(o_stack: jax.Array, lse_stack: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge N states in one pass; o_stack [N, B, T, H, D] or [N, B, H, D], lse_stack [N, ...]."""
    if o_stack.ndim not in (4, 5) or lse_stack.shape[:1] != o_stack.shape[:1]:
        raise ValueError(
            f"o_stack has shape {o_stack.shape} and lse_stack {lse_stack.shape}; allowed: a "
            "shared leading axis N over [B, T, H, D] / [B, H, T] or [B, H, D] / [B, H]")
    n = o_stack.shape[0]
    if o_stack.ndim == 5:
        _, b, t, h, _ = o_stack.shape
        if lse_stack.shape != (n, b, h, t):
            raise ValueError(f"lse_stack has shape {lse_stack.shape} for o_stack of shape "
                             f"{o_stack.shape}; allowed: {(n, b, h, t)}")
        o, lse = merge_stack(o_stack, jnp.swapaxes(lse_stack, 2, 3))
        return o, jnp.swapaxes(lse, 1, 2)
    if lse_stack.shape != o_stack.shape[:3]:
        raise ValueError(f"lse_stack has shape {lse_stack.shape} for o_stack of shape "
                         f"{o_stack.shape}; allowed: {o_stack.shape[:3]}")
    return merge_stack(o_stack, lse_stack)
