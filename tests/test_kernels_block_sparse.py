"""block_sparse_attention_with_lse (Pallas, interpret mode) and its jnp twin against a float64
NumPy reference, on random block masks with empty lists and poisoned padding entries; with every
block listed they must give the dense kernels' results (the Pallas kernel bit for bit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_sparse as bs_mod
from pallas_kernels.attention import attention_with_lse, attention_with_lse_xla
from pallas_kernels.block_sparse import (
    block_sparse_attention_with_lse,
    block_sparse_attention_with_lse_xla,
    mask_to_block_lists,
)
from kernel_reference import assert_attention_close, block_sparse_attention_ref, rel_err

SPARSE = {"pallas": block_sparse_attention_with_lse, "xla": block_sparse_attention_with_lse_xla}

# Padding entries of the lists: out of range both ways (a read would fault on a GPU or clamp
# onto another block in interpret mode) or a real block that is not listed.
_OUT_OF_RANGE = (-1, 2**30)

# (B, Tq, Tk, Hq, Hkv, D, block_size, causal, q_offset, kv_len, dtype, out_dtype). Lengths are
# not multiples of the block size; each case mixes several features so the interpret-mode
# compiles stay few.
CASES = {
    # float32 tiles of 32 keys: two tiles per 64-key block; batch 1 starts at a negative offset
    # (its first 30 rows see nothing) and has a short kv_len.
    "f32_gqa2_causal_offsets_kvlen": (2, 150, 230, 4, 2, 64, 64, True, [80, -30], [230, 150],
                                      "float32", None),
    # Chunked prefill: 200 queries at position 256 attend earlier key blocks and their own.
    "bf16_gqa4_chunk_f32_out": (1, 200, 456, 8, 2, 64, 128, True, 256, None, "bfloat16",
                                "float32"),
    # block_size 16: one 16-key tile per block; no causal mask, scalar kv_len mid-block.
    "f32_noncausal_bs16_kvlen": (2, 40, 100, 2, 2, 32, 16, False, 0, 77, "float32", None),
}


def _inputs(seed, case):
    b, tq, tk, hq, hkv, d, *_, dtype, _ = CASES[case]
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal(s).astype(np.float32)
            for s in ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d))]
    jarrs = [jnp.asarray(a, dtype) for a in arrs]
    # The reference sees exactly the (possibly bf16-rounded) values the kernel sees.
    return jarrs, [np.asarray(a.astype(jnp.float32)) for a in jarrs]


def _grid(case):
    b, tq, tk, hq, _, _, block_size, *_ = CASES[case]
    return b, hq, -(-tq // block_size), -(-tk // block_size)


def _random_mask(rng, case, density=0.5):
    """Random blocks plus a few lists emptied on purpose (count 0)."""
    shape = _grid(case)
    mask = rng.random(shape) < density
    mask[0, 0, 0] = False
    mask[-1, -1, -1] = False
    return mask


def _lists(mask, rng):
    """mask_to_block_lists with every padding entry replaced by poison."""
    kv_blocks, counts = mask_to_block_lists(jnp.asarray(mask))
    kv_blocks, counts = np.asarray(kv_blocks), np.asarray(counts)
    nkb = mask.shape[-1]
    pad = np.arange(kv_blocks.shape[-1]) >= counts[..., None]
    poison = rng.choice(np.array([*_OUT_OF_RANGE, nkb - 1, 0]), size=kv_blocks.shape)
    return jnp.asarray(np.where(pad, poison, kv_blocks), jnp.int32), jnp.asarray(counts)


def _call(fn, case, q, k, v, kv_blocks, counts):
    *_, block_size, causal, q_offset, kv_len, _, out_dtype = CASES[case]
    return fn(q, k, v, kv_blocks, counts, block_size=block_size, causal=causal,
              q_offset=jnp.asarray(q_offset, jnp.int32),
              kv_len=None if kv_len is None else jnp.asarray(kv_len, jnp.int32),
              out_dtype=None if out_dtype is None else jnp.dtype(out_dtype))


def _check_against_reference(impl, case, inputs, mask, kv_blocks, counts):
    (q, k, v), (qn, kn, vn) = inputs
    *_, block_size, causal, q_offset, kv_len, dtype, out_dtype = CASES[case]
    ref_o, ref_lse = block_sparse_attention_ref(qn, kn, vn, mask, block_size=block_size,
                                                causal=causal, q_offset=q_offset, kv_len=kv_len)
    o, lse = _call(SPARSE[impl], case, q, k, v, kv_blocks, counts)
    assert o.dtype == jnp.dtype(out_dtype or dtype) and o.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert_attention_close(o, lse, ref_o, ref_lse, tol=tol, lse_tol=max(1e-5, tol))
    return o, lse


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_random_masks_match_float64(impl, case):
    seed = 5000 + list(CASES).index(case) * 10 + (impl == "xla")
    rng = np.random.default_rng(seed)
    mask = _random_mask(rng, case)
    kv_blocks, counts = _lists(mask, rng)
    _check_against_reference(impl, case, _inputs(seed, case), mask, kv_blocks, counts)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_diagonal_blocks_only_match_float64(impl):
    """Only the diagonal block select_blocks forces (the one holding the query block's first
    position); batch 1's first query block starts before key 0, so its list is empty."""
    case = "f32_gqa2_causal_offsets_kvlen"
    b, hq, nqb, nkb = _grid(case)
    block_size, q_offset = CASES[case][6], np.asarray(CASES[case][8])
    diag = (q_offset[:, None] + np.arange(nqb)[None, :] * block_size) // block_size  # [B, nqb]
    mask = np.zeros((b, hq, nqb, nkb), dtype=bool)
    for bi in range(b):
        for i in range(nqb):
            if 0 <= diag[bi, i] < nkb:
                mask[bi, :, i, diag[bi, i]] = True
    rng = np.random.default_rng(5100 + (impl == "xla"))
    kv_blocks, counts = _lists(mask, rng)
    _check_against_reference(impl, case, _inputs(5100, case), mask, kv_blocks, counts)


@pytest.mark.parametrize("case", ["f32_gqa2_causal_offsets_kvlen", "bf16_gqa4_chunk_f32_out"])
def test_every_block_listed_equals_dense(case):
    """Listing every key block (the causally hidden ones too) gives attention_with_lse's bits
    (block_q = block_size, same block_k), and the jnp twin attention_with_lse_xla's o and lse within 1e-6 relative
    (it gathers the blocks and sums the same terms in another order: how far apart depends on the compiler's
    float32 code, 3 ulp of an lse of 6.5 at XLA's CPU optimisation level 0)."""
    *_, block_size, causal, q_offset, kv_len, _, out_dtype = CASES[case]
    (q, k, v), _ = _inputs(5200 + list(CASES).index(case), case)
    kv_blocks, counts = mask_to_block_lists(jnp.ones(_grid(case), bool))
    dense_kwargs = dict(causal=causal, q_offset=jnp.asarray(q_offset, jnp.int32),
                        kv_len=None if kv_len is None else jnp.asarray(kv_len, jnp.int32),
                        out_dtype=None if out_dtype is None else jnp.dtype(out_dtype))

    o, lse = _call(block_sparse_attention_with_lse, case, q, k, v, kv_blocks, counts)
    o_dense, lse_dense = attention_with_lse(q, k, v, block_q=block_size, **dense_kwargs)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_dense))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_dense))

    o, lse = _call(block_sparse_attention_with_lse_xla, case, q, k, v, kv_blocks, counts)
    o_dense, lse_dense = attention_with_lse_xla(q, k, v, **dense_kwargs)
    assert rel_err(o, o_dense) <= 1e-6
    lse, lse_dense = np.asarray(lse), np.asarray(lse_dense)
    seen = np.isfinite(lse_dense)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert rel_err(lse[seen], lse_dense[seen]) <= 1e-6


def test_new_lists_and_offsets_do_not_recompile():
    """The lists, counts, q_offset and kv_len are traced: new values reuse the compiled kernel."""
    case = "f32_gqa2_causal_offsets_kvlen"
    (q, k, v), _ = _inputs(5300, case)
    rng = np.random.default_rng(5300)
    fast, _ = bs_mod._block_sparse_pallas.jitted
    sizes = []
    for density, q_offset in [(0.3, 5), (0.8, 70)]:
        kv_blocks, counts = _lists(_random_mask(rng, case, density), rng)
        block_sparse_attention_with_lse(q, k, v, kv_blocks, counts, block_size=64, causal=True,
                                        q_offset=q_offset, kv_len=jnp.asarray([200, 99]),
                                        interpret=True)
        sizes.append(fast._cache_size())
    assert sizes[0] == sizes[1]


def test_mask_to_block_lists_is_ascending_and_jittable():
    mask = np.array([[[[False, True, False, True, True],
                       [False, False, False, False, False],
                       [True, True, True, True, True]]]])
    kv_blocks, counts = jax.jit(mask_to_block_lists)(jnp.asarray(mask))
    assert kv_blocks.dtype == jnp.int32 and counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(counts), [[[3, 0, 5]]])
    np.testing.assert_array_equal(np.asarray(kv_blocks)[0, 0, 0, :3], [1, 3, 4])
    np.testing.assert_array_equal(np.asarray(kv_blocks)[0, 0, 2], [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="mask has dtype"):
        mask_to_block_lists(jnp.asarray(mask, jnp.int32))


@pytest.mark.parametrize("fn", list(SPARSE.values()))
def test_rejects_bad_arguments(fn):
    q = jnp.ones((1, 40, 4, 64))
    k = jnp.ones((1, 100, 2, 64))
    lists = jnp.zeros((1, 4, 3, 7), jnp.int32)  # block_size 16: 3 query blocks
    counts = jnp.zeros((1, 4, 3), jnp.int32)
    with pytest.raises(ValueError, match="block_size=48"):
        fn(q, k, k, lists, counts, block_size=48)
    with pytest.raises(ValueError, match="block_size=8"):
        fn(q, k, k, lists, counts, block_size=8)
    with pytest.raises(ValueError, match="kv_blocks has shape"):
        fn(q, k, k, lists, counts, block_size=32)
    with pytest.raises(ValueError, match="kv_blocks has shape"):
        fn(q, k, k, lists[..., :0], counts, block_size=16)
    with pytest.raises(ValueError, match="kv_block_counts has shape"):
        fn(q, k, k, lists, counts[..., :2], block_size=16)
    with pytest.raises(ValueError, match="kv_blocks has dtype"):
        fn(q, k, k, lists.astype(jnp.float32), counts, block_size=16)
    with pytest.raises(ValueError, match="Hq=4 is not a multiple of Hkv=3"):
        fn(q, jnp.ones((1, 100, 3, 64)), jnp.ones((1, 100, 3, 64)), lists, counts, block_size=16)
