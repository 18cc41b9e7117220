"""XAttention estimate: KV-chunked Pallas pipeline == one-shot, both == float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from kernel_reference import select_blocks_ref, xattn_block_sums_ref

# (B, Tq, Tk, Hq, Hkv, D, stride, block_size, causal, q_offset, kv_len, kv_chunks):
# lengths are not multiples of the stride or block; chunk lists are passed as kv_chunk values.
CASES = {
    "causal_gqa2_offset_kvlen": (2, 70, 200, 4, 2, 64, 4, 32, True, [130, 100], [200, 150],
                                 [None, 64]),
    # block 96 / stride 8: 12 tiles per block, not a power of two (jnp block-sum fallback)
    "causal_gqa4_prefill_end_block96": (1, 100, 300, 8, 2, 128, 8, 96, True, 200, None, [192]),
    "noncausal_gqa1_kvlen": (1, 50, 90, 2, 2, 64, 4, 16, False, 0, [61], [None, 32]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_equals_one_shot_and_float64(case):
    b, tq, tk, hq, hkv, d, stride, block, causal, q_offset, kv_len, chunks = CASES[case]
    rng = np.random.default_rng(500 + list(CASES).index(case))
    q = rng.standard_normal((b, tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, tk, hkv, d)).astype(np.float32)
    ref = xattn_block_sums_ref(q, k, stride=stride, block_size=block, causal=causal,
                               q_offset=q_offset, kv_len=kv_len)
    ref_mask = select_blocks_ref(ref, threshold=0.9, block_size=block, q_offset=q_offset)
    args = dict(block_size=block, stride=stride, causal=causal, threshold=0.9,
                q_offset=jnp.asarray(q_offset, jnp.int32),
                kv_len=None if kv_len is None else jnp.asarray(kv_len, jnp.int32))
    one_sums, one_mask = pk.xattn_estimate(jnp.asarray(q), jnp.asarray(k), impl="xla", **args)
    np.testing.assert_allclose(np.asarray(one_sums), ref, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(one_mask), ref_mask)
    for chunk in chunks:
        sums, mask = pk.xattn_estimate(jnp.asarray(q), jnp.asarray(k), impl="pallas",
                                       kv_chunk=chunk, **args)
        assert sums.shape == ref.shape and mask.dtype == jnp.bool_
        np.testing.assert_allclose(np.asarray(sums), np.asarray(one_sums), rtol=0, atol=1e-5,
                                   err_msg=f"kv_chunk={chunk}")
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(one_mask),
                                      err_msg=f"kv_chunk={chunk}")


def test_key_splits_fold_to_the_row_stats():
    """Programs over splits of the keys (what fills the GPU for a chunk after a 1M-token prefix) give the one
    program's scores to the bit and its stats within rounding; a row's stats are the same bits whatever hidden keys
    past it the call holds (a chunk's span bucket against the whole prompt's length)."""
    seed = 43
    rng = np.random.default_rng(seed)
    b, tq, tk, hq, hkv, d, stride = 1, 60, 256, 4, 2, 64, 4
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, 2 * tk, hkv, d)), jnp.float32)
    args = dict(stride=stride, q_offset=196, block_n=16)
    scores, m, l = pk.antidiagonal_scores(q, k[:, :tk], key_split=64, **args)  # one split of 64 tiles
    split_scores, split_m, split_l = pk.antidiagonal_scores(q, k[:, :tk], key_split=16, **args)
    np.testing.assert_array_equal(np.asarray(split_scores), np.asarray(scores), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(split_m), np.asarray(m), err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(split_l), np.asarray(l), rtol=1e-6, err_msg=f"seed {seed}")
    _, long_m, long_l = pk.antidiagonal_scores(q, k, kv_len=tk, key_split=16, **args)
    np.testing.assert_array_equal(np.asarray(long_m), np.asarray(split_m), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(long_l), np.asarray(split_l), err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="key_split=24"):
        pk.antidiagonal_scores(q, k, key_split=24, **args)


def test_scores_stats_and_merge():
    """Kernel scores match the one-shot scores; fused stats == softmax_partial_stats; merged
    per-chunk stats == stats of the whole row; normalised block sums of each row sum to 1."""
    rng = np.random.default_rng(42)
    b, tq, tk, hq, hkv, d, stride, block = 1, 60, 256, 4, 1, 64, 4, 64
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, tk, hkv, d)), jnp.float32)
    scores, m, l = pk.antidiagonal_scores(q, k, stride=stride, q_offset=196)
    m_ref, l_ref = pk.softmax_partial_stats(scores)
    np.testing.assert_allclose(np.asarray(m), np.asarray(m_ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l), np.asarray(l_ref), rtol=1e-5)

    parts = [pk.antidiagonal_scores(q, k[:, c0:c0 + 128], stride=stride, q_offset=196,
                                    k_offset=c0) for c0 in (0, 128)]
    np.testing.assert_array_equal(
        np.asarray(jnp.concatenate([p[0] for p in parts], axis=-1)), np.asarray(scores))
    m_all, l_all = pk.merge_softmax_stats([p[1] for p in parts], [p[2] for p in parts])
    np.testing.assert_allclose(np.asarray(m_all), np.asarray(m), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l_all), np.asarray(l), rtol=1e-5)

    sums = pk.softmax_normalize_block_sum(scores, m, l, block_size=block, stride=stride,
                                          q_offset=196)
    rows = np.asarray(sums).sum(axis=-1)
    r = block // stride
    full_blocks = -(-tq // stride) // r  # query blocks holding r tile rows
    np.testing.assert_allclose(rows[..., :full_blocks], r, rtol=1e-5)


def test_select_blocks_matches_reference():
    rng = np.random.default_rng(9)
    sums = rng.random((2, 3, 6, 10)).astype(np.float32)
    sums[rng.random(sums.shape) < 0.3] = 0.0  # hidden blocks carry no mass
    for threshold in (0.3, 0.8, 1.0):
        mask = pk.select_blocks(jnp.asarray(sums), threshold=threshold, block_size=32,
                                q_offset=jnp.asarray([64, 0]))
        ref = select_blocks_ref(sums, threshold=threshold, block_size=32, q_offset=[64, 0])
        np.testing.assert_array_equal(np.asarray(mask), ref)


def test_rejects_bad_arguments():
    q = jnp.ones((1, 16, 2, 64))
    with pytest.raises(ValueError, match="block_size=20 is not a multiple of stride=8"):
        pk.xattn_estimate(q, q, block_size=20, stride=8)
    with pytest.raises(ValueError, match="kv_chunk=48"):
        pk.xattn_estimate(q, jnp.ones((1, 128, 2, 64)), block_size=32, stride=4, kv_chunk=48)
