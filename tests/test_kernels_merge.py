"""merge_states / merge_states_n against float64, and chunked attention + merges == whole."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from kernel_reference import assert_attention_close, merge_ref


def _states(rng, n, b, t, h, d, empty_frac=0.2):
    """n random states in attention layout; some (state, row) pairs empty with garbage o."""
    o = rng.standard_normal((n, b, t, h, d)).astype(np.float32)
    lse = (rng.standard_normal((n, b, h, t)) * 4).astype(np.float32)
    empty = rng.random((n, b, h, t)) < empty_frac
    empty[:, 0, 0, 0] = True  # a row where every state is empty
    lse[empty] = -np.inf
    o[np.swapaxes(empty, -1, -2)] = np.nan  # an empty state's o must be ignored
    return o, lse


@pytest.mark.parametrize("seed", [0, 1])
def test_merge_states_matches_float64(seed):
    rng = np.random.default_rng(100 + seed)
    o, lse = _states(rng, 2, 2, 9, 3, 16)
    ref_o, ref_lse = merge_ref(o, lse)
    mo, ml = pk.merge_states(jnp.asarray(o[0]), jnp.asarray(lse[0]), jnp.asarray(o[1]),
                             jnp.asarray(lse[1]))
    assert mo.dtype == jnp.float32 and ml.dtype == jnp.float32
    assert_attention_close(mo, ml, ref_o, ref_lse, tol=1e-6)


def test_merge_states_n_matches_float64_both_layouts():
    rng = np.random.default_rng(7)
    o, lse = _states(rng, 5, 2, 11, 4, 32)
    ref_o, ref_lse = merge_ref(o, lse)
    mo, ml = pk.merge_states_n(jnp.asarray(o), jnp.asarray(lse))
    assert_attention_close(mo, ml, ref_o, ref_lse, tol=1e-6)
    # decode layout: o [N, B, H, D], lse [N, B, H]
    mo, ml = pk.merge_states_n(jnp.asarray(o[:, :, 0]), jnp.asarray(lse[..., 0]))
    assert_attention_close(mo, ml, ref_o[:, 0], ref_lse[..., 0], tol=1e-6)
    # a bf16 input state is promoted; the merged o stays float32
    mo, _ = pk.merge_states(jnp.asarray(o[0, :, 1:], jnp.bfloat16), jnp.asarray(lse[0, ..., 1:]),
                            jnp.asarray(o[1, :, 1:], jnp.bfloat16), jnp.asarray(lse[1, ..., 1:]))
    assert mo.dtype == jnp.float32


def test_merge_rejects_mismatched_layout():
    o = jnp.ones((1, 5, 3, 8))
    with pytest.raises(ValueError, match="allowed: \\(1, 3, 5\\)"):
        pk.merge_states(o, jnp.ones((1, 5, 3)), o, jnp.ones((1, 3, 5)))


@pytest.mark.parametrize("n_chunks", [1, 3, 16, 256])
def test_chunked_attention_merged_equals_whole(n_chunks):
    """K/V split into n chunks (uneven), each attended separately, merged pairwise in
    sequence and N-way, reproduces the unsplit causal attention (float32, 1e-5)."""
    rng = np.random.default_rng(300 + n_chunks)
    b, tq, tk, hq, hkv, d, q_offset = 1, 21, 256, 4, 2, 64, 240
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, tk, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, tk, hkv, d)), jnp.float32)
    whole_o, whole_lse = pk.attention_with_lse(q, k, v, causal=True, q_offset=q_offset)

    # All chunks in one call: chunk c becomes batch entry c, padded to the longest chunk, with
    # its keys' absolute start folded into q_offset and its true length as kv_len.
    bounds = np.linspace(0, tk, n_chunks + 1).round().astype(int)
    length = int(np.max(np.diff(bounds)))
    kc = np.zeros((n_chunks, length, hkv, d), np.float32)
    vc = np.zeros((n_chunks, length, hkv, d), np.float32)
    for c, (c0, c1) in enumerate(zip(bounds[:-1], bounds[1:])):
        kc[c, :c1 - c0] = np.asarray(k[0, c0:c1])
        vc[c, :c1 - c0] = np.asarray(v[0, c0:c1])
    o, lse = pk.attention_with_lse(
        jnp.broadcast_to(q, (n_chunks, tq, hq, d)), jnp.asarray(kc), jnp.asarray(vc),
        causal=True, q_offset=jnp.asarray(q_offset - bounds[:-1], jnp.int32),
        kv_len=jnp.asarray(np.diff(bounds), jnp.int32))
    o_states, lse_states = o[:, None], lse[:, None]  # [N, B=1, ...]

    n_way_o, n_way_lse = pk.merge_states_n(o_states, lse_states)
    seq_o, seq_lse = o_states[0], lse_states[0]
    for c in range(1, n_chunks):
        seq_o, seq_lse = pk.merge_states(seq_o, seq_lse, o_states[c], lse_states[c])
    ref = (np.asarray(whole_o, np.float64), np.asarray(whole_lse, np.float64))
    assert_attention_close(n_way_o, n_way_lse, *ref, tol=1e-5)
    assert_attention_close(seq_o, seq_lse, *ref, tol=1e-5)
