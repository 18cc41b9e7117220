"""The Hopper (Mosaic GPU) block-sparse attention kernel, pallas_kernels/mgpu_block_sparse.py, in Mosaic GPU's CPU
interpreter, against float64 references: random block lists (an empty one, padding entries poisoned), causal
with the diagonal blocks listed, a kv_len cut inside a listed block, GQA 2:1, shapes that are no multiple of the
blocks; with every visible block listed, the bits of the dense Mosaic GPU kernel; lowering for CUDA; and the
routing of `block_sparse_attention_with_lse` to it.

The interpreter compiles the kernel once per CTA (about 1.3 s each on the 2-core machine), and a CTA here is a
whole query block of 128 rows (block_size must be 128), so the calls are 4 and 1 + 1 CTAs. On the GPU,
bench/probes/probe_mgpu_block_sparse.py checks more cases at full size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_sparse as bs_mod
from pallas_kernels import mgpu_attention as mga
from pallas_kernels import mgpu_block_sparse as mbs
from pallas_kernels.block_sparse import mask_to_block_lists
from kernel_reference import assert_attention_close, block_sparse_attention_ref

TOL = 1e-2  # bf16 inputs, P rounded to bf16 before P V (as tests/test_kernels_mgpu.py)
BS = mbs.BLOCK_SIZE


pytestmark = pytest.mark.usefixtures("unoptimised_compiles")


def _inputs(seed, b, tq, tk, hq, hkv, d=64):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d)))
    # The reference sees exactly the bf16-rounded values the kernel sees.
    return (q, k, v), [np.asarray(x.astype(jnp.float32)) for x in (q, k, v)]


def _lists(mask, rng):
    """mask_to_block_lists with every padding entry replaced by poison (out of range either way, or a real
    block that is not listed): a read of one would show."""
    kv_blocks, counts = (np.asarray(x) for x in mask_to_block_lists(jnp.asarray(mask)))
    pad = np.arange(kv_blocks.shape[-1]) >= counts[..., None]
    poison = rng.choice(np.array([-1, 2**30, mask.shape[-1] - 1, 0]), size=kv_blocks.shape)
    return jnp.asarray(np.where(pad, poison, kv_blocks), jnp.int32), jnp.asarray(counts)


def test_random_lists_match_float64():
    """Causal, GQA 2:1, 200 queries at positions 100..299 (two query blocks, the second padded) over 350 keys
    (three key blocks, the last padded) with kv_len 300, a random list per (head, query block), bf16 output.
    Query block 0 straddles key blocks 0 and 1 (block 0 masked in warpgroup 0 only); query block 1 sees block 0
    whole, block 1 unmasked in warpgroup 1 only and block 2 up to its kv_len cut. Head 1's first list is empty
    (its rows: o = 0, lse = -inf); head 0 lists both diagonal blocks and the cut one."""
    seed = 6000
    b, tq, tk, hq, hkv, q_offset, kv_len = 1, 200, 350, 2, 1, 100, 300
    (q, k, v), (qn, kn, vn) = _inputs(seed, b, tq, tk, hq, hkv)
    rng = np.random.default_rng(seed)
    mask = rng.random((b, hq, 2, 3)) < 0.5
    mask[0, 0, 0, :2] = mask[0, 0, 1, 1:] = True
    mask[0, 1, 0] = False
    kv_blocks, counts = _lists(mask, rng)
    o, lse = mbs.block_sparse_attention_with_lse_mgpu(q, k, v, kv_blocks, counts, causal=True, q_offset=q_offset,
                                                      kv_len=jnp.asarray(kv_len, jnp.int32), interpret=True)
    assert o.dtype == jnp.bfloat16 and o.shape == q.shape and lse.shape == (b, hq, tq)
    ref_o, ref_lse = block_sparse_attention_ref(qn, kn, vn, mask, block_size=BS, causal=True, q_offset=q_offset,
                                                kv_len=kv_len)
    assert np.isneginf(ref_lse[0, 1, :BS]).all()
    assert_attention_close(o.astype(jnp.float32), lse, ref_o, ref_lse, tol=TOL, lse_tol=TOL, seed=seed)


def test_every_visible_block_listed_gives_the_dense_kernels_bits():
    """One query block (100 queries at positions 200..299, padded to 128) over 300 keys with kv_len 290, causal,
    float32 output, every key block listed: the dense kernel's steps exactly (block 0 unmasked, block 1 masked
    in warpgroup 0 and unmasked in warpgroup 1, block 2 masked), so `attention_with_lse_mgpu`'s bits."""
    seed = 6100
    b, tq, tk, q_offset, kv_len = 1, 100, 300, 200, 290
    (q, k, v), (qn, kn, vn) = _inputs(seed, b, tq, tk, 1, 1)
    kv_blocks, counts = mask_to_block_lists(jnp.ones((b, 1, 1, 3), bool))
    o, lse = mbs.block_sparse_attention_with_lse_mgpu(q, k, v, kv_blocks, counts, causal=True, q_offset=q_offset,
                                                      kv_len=kv_len, out_dtype=jnp.float32, interpret=True)
    dense_o, dense_lse = mga.attention_with_lse_mgpu(q, k, v, causal=True, q_offset=q_offset, kv_lengths=kv_len,
                                                     out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(dense_o), err_msg=f"seed {seed}: o")
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(dense_lse), err_msg=f"seed {seed}: lse")
    ref_o, ref_lse = block_sparse_attention_ref(qn, kn, vn, np.ones((b, 1, 1, 3), bool), block_size=BS,
                                                causal=True, q_offset=q_offset, kv_len=kv_len)
    assert_attention_close(o, lse, ref_o, ref_lse, tol=TOL, lse_tol=TOL, seed=seed)


def test_lowers_for_cuda():
    """Every variant (causal or not, O through Q's buffer, in its own and aliased over Q and K; both lowerings)
    lowers to a Mosaic GPU kernel on this CPU-only machine: the interpreter skips the layout inference and the
    lowering that the GPU build runs."""
    b, tq, tk, hq, hkv, d = 2, 1000, 1000, 8, 2, 128
    nqb = -(-tq // BS)
    q = jax.ShapeDtypeStruct((b, tq, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, tk, hkv, d), jnp.bfloat16)
    lists = jax.ShapeDtypeStruct((b, hq, nqb, -(-tk // BS)), jnp.int32)
    counts = jax.ShapeDtypeStruct((b, hq, nqb), jnp.int32)
    variants = {
        "causal, bf16 out, warpgroup": dict(causal=True),
        "non-causal, float32 out aliased over Q and K, 3 slots": dict(out_dtype=jnp.float32, max_concurrent_steps=3),
        "causal, float32 out, lane": dict(causal=True, out_dtype=jnp.float32, semantics="lane"),
    }
    for name, kw in variants.items():
        def fn(q, k, v, kv_blocks, counts, kw=kw):
            return mbs.block_sparse_attention_with_lse_mgpu(q, k, v, kv_blocks, counts, q_offset=24, kv_len=990,
                                                            **kw)
        try:
            jax.jit(fn).trace(q, kv, kv, lists, counts).lower(lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{name}: {type(e).__name__}: {str(e)[-400:]}") from None


def test_block_sparse_attention_routes_to_the_hopper_kernel(monkeypatch):
    """`block_sparse_attention_with_lse` takes the Mosaic kernel under the dense route's conditions plus
    block_size 128, and Triton otherwise. The GPU-only parts are stubbed: the device check (as on an H100/H200)
    and both kernels (recorders); `runs_on_hopper_kernel` and `is_supported` run for real."""
    calls = []
    monkeypatch.setattr(mga, "is_supported", lambda *a, **kw: True)
    monkeypatch.setattr(mbs, "block_sparse_attention_with_lse_mgpu",
                        lambda *a, **kw: calls.append(("mosaic", kw)) or "mosaic")
    monkeypatch.setattr(bs_mod, "_block_sparse_pallas", lambda *a, **kw: calls.append(("triton", kw)) or "triton")
    q = jnp.zeros((1, 200, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 300, 2, 64), jnp.bfloat16)

    def call(block_size=BS, **kw):
        nqb = -(-200 // block_size)
        lists = jnp.zeros((1, 4, nqb, 3), jnp.int32)
        return bs_mod.block_sparse_attention_with_lse(q, k, k, lists, jnp.ones((1, 4, nqb), jnp.int32),
                                                      block_size=block_size, interpret=False, **kw)

    assert call(causal=True, q_offset=7, kv_len=250, sm_scale=0.1, out_dtype=jnp.float32) == "mosaic"
    _, kw = calls[-1]
    assert kw["causal"] and kw["sm_scale"] == 0.1 and kw["out_dtype"] == jnp.float32
    assert np.asarray(kw["q_offset"]).tolist() == [7] and np.asarray(kw["kv_len"]).tolist() == [250]
    assert call(block_size=64) == "triton"
    assert call(num_warps=4) == "triton"
    monkeypatch.setenv("JAX_OFFLOAD_HOPPER_ATTENTION", "0")
    assert call() == "triton"
