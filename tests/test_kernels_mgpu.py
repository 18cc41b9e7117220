"""The Hopper (Mosaic GPU) attention kernel, pallas_kernels/mgpu_attention.py, in Mosaic GPU's CPU interpreter
(it simulates the warpgroups, barriers and TMA copies of the GPU kernel; the kernel runs its steps there one at a
time, with dots for the wgmmas, where the GPU overlaps them: the same operations on each row's state): the state
contract it shares with the Triton kernel (input state, raw-state output, keys streamed in blocks give the bits of
one call), packed sequences (kv_start) and shapes that are no multiple of the tiles, against float64 references.
The GPU's overlapped code is lowered here (`test_lowers_for_cuda`) and run on the GPU by
bench/probes/probe_mgpu_kernel.py, which checks the same at full size.

The interpreter compiles the kernel's body for every CTA (and each of its three warpgroups), about 1 s each on
the 2-core machine even unoptimised, so every call here is one or two CTAs (one head, D 64, 64 x 64 tiles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import mgpu_attention as mga
from kernel_reference import assert_attention_close, attention_ref

TILES = dict(block_q=64, block_kv=64, max_concurrent_steps=2, interpret=True)
TOL = 1e-2  # bf16 inputs, P rounded to bf16 before P V (as tests/test_kernels_attention.py for bf16)


pytestmark = pytest.mark.usefixtures("unoptimised_compiles")


def _inputs(seed, q_shape, kv_shape):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in (q_shape, kv_shape, kv_shape))
    # The reference sees exactly the bf16-rounded values the kernel sees.
    return (q, k, v), [np.asarray(x.astype(jnp.float32)) for x in (q, k, v)]


def test_keys_streamed_in_blocks_give_the_bits_of_one_call():
    """Causal queries (Tq = 100: one padded CTA) over 171 keys (a padded last block): one call over all of them
    matches float64, and the keys in two calls, a block of 128 whose raw state (`attention_state_mgpu`) the
    finishing call over the other 43 resumes, give exactly its bits."""
    seed = 5000
    tq, tk, q_offset, split = 100, 171, 60, 128  # positions 60..159: keys 160..170 are seen by no query
    (q, k, v), (qn, kn, vn) = _inputs(seed, (1, tq, 1, 64), (1, tk, 1, 64))
    o, lse = mga.attention_with_lse_mgpu(q, k, v, causal=True, q_offset=q_offset, **TILES)
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=True, q_offset=q_offset)
    assert_attention_close(o, lse, ref_o, ref_lse, tol=TOL, lse_tol=TOL, seed=seed)

    # Each call's q_offset is relative to its first key.
    state = mga.attention_state_mgpu(q, k[:, :split], v[:, :split], causal=True, q_offset=q_offset, **TILES)
    assert state.acc.shape == q.shape and state.m.shape == state.l.shape == (1, 1, tq)
    so, slse = mga.attention_with_lse_mgpu(q, k[:, split:], v[:, split:], state=state, causal=True,
                                           q_offset=q_offset - split, **TILES)
    np.testing.assert_array_equal(np.asarray(so), np.asarray(o), err_msg=f"seed {seed}: o")
    np.testing.assert_array_equal(np.asarray(slse), np.asarray(lse), err_msg=f"seed {seed}: lse")


def test_packed_sequences_match_float64():
    """kv_start, one CTA of 128 queries over 256 keys, bfloat16 output. Non-causal, so that one CTA holds all
    the cases of the block ranges: its smallest start (70) skips key block 0; warpgroup 0 mixes two sequences and
    a row pushed past every key (all its blocks masked); warpgroup 1 (starts 100 and 130) runs blocks 1 and 2
    masked and block 3 unmasked. Causal packed rows: the next test."""
    seed = 5100
    tq, tk = 128, 256
    (q, k, v), (qn, kn, vn) = _inputs(seed, (1, tq, 1, 64), (1, tk, 1, 64))
    starts = np.repeat(np.array([70, 100, 100, 130], np.int32), [20, 44, 36, 28])[None]
    starts[0, 7] = tk  # sees no key
    o, lse = mga.attention_with_lse_mgpu(q, k, v, causal=False, kv_start=jnp.asarray(starts),
                                         out_dtype=jnp.bfloat16, **TILES)
    assert o.dtype == jnp.bfloat16
    ref_o, ref_lse = attention_ref(qn, kn, vn, kv_start=starts)
    assert_attention_close(o.astype(jnp.float32), lse, ref_o, ref_lse, tol=TOL, lse_tol=TOL, seed=seed)


def test_state_from_another_kernel_resumes_and_returns_the_raw_state():
    """A state over the first 100 keys from the jnp twin (`attention_state_xla`; causal, packed, so the rows of
    the third sequence have seen nothing yet: m = -inf) continued by `attention_state_mgpu` over the other 92
    keys (a padded block): the raw state it returns finishes (`finish_state`) to float64 attention over all
    192 keys."""
    seed = 5200
    tq, tk, split, q_offset = 128, 192, 100, 64  # positions 64..191
    (q, k, v), (qn, kn, vn) = _inputs(seed, (1, tq, 1, 64), (1, tk, 1, 64))
    bounds = np.array([0, 94, 130])  # three sequences; queries from position 64 on
    starts = bounds[np.searchsorted(bounds, q_offset + np.arange(tq), side="right") - 1][None].astype(np.int32)
    earlier = pk.attention_state_xla(q, k[:, :split], v[:, :split], causal=True, q_offset=q_offset,
                                     kv_start=jnp.asarray(starts))
    assert np.isneginf(np.asarray(earlier.m)).any() and np.isfinite(np.asarray(earlier.m)).any()
    state = mga.attention_state_mgpu(q, k[:, split:], v[:, split:], earlier, causal=True, q_offset=q_offset - split,
                                     kv_start=jnp.asarray(starts - split), **TILES)
    assert all(x.dtype == jnp.float32 for x in state)
    o, lse = pk.finish_state(state)
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=True, q_offset=q_offset, kv_start=starts)
    assert_attention_close(o, lse, ref_o, ref_lse, tol=TOL, lse_tol=TOL, seed=seed)


@pytest.mark.parametrize("semantics", ["warpgroup", "lane"])
def test_lowers_for_cuda(semantics):
    """Every variant (finish or raw-state output, input state, kv_start causal or not, padded shapes; O through
    Q's buffer, in its own and aliased over Q and K) lowers to a Mosaic GPU kernel on this CPU-only machine:
    the interpreter skips the layout inference and the lowering that the GPU build runs."""
    b, tq, tk, hq, hkv, d = 2, 1000, 1000, 8, 2, 128
    q = jax.ShapeDtypeStruct((b, tq, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, tk, hkv, d), jnp.bfloat16)
    state = pk.AttentionState(jax.ShapeDtypeStruct((b, tq, hq, d), jnp.float32),
                              *[jax.ShapeDtypeStruct((b, hq, tq), jnp.float32)] * 2)
    starts = jax.ShapeDtypeStruct((b, tq), jnp.int32)
    variants = {
        "finish, state in, packed, bf16 out": lambda q, k, v, s, ks: mga.attention_with_lse_mgpu(
            q, k, v, state=s, kv_start=ks, out_dtype=jnp.bfloat16, semantics=semantics),
        "state out, packed, non-causal, O aliased": lambda q, k, v, s, ks: mga.attention_state_mgpu(
            q, k, v, causal=False, kv_start=ks, max_concurrent_steps=3, semantics=semantics),
        "state in and out": lambda q, k, v, s, ks: mga.attention_state_mgpu(q, k, v, s, semantics=semantics),
    }
    for name, fn in variants.items():
        try:
            jax.jit(fn).trace(q, kv, kv, state, starts).lower(lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{name} ({semantics}): {type(e).__name__}: {str(e)[-400:]}") from None
