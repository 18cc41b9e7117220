"""paged_decode_attention_with_lse (Pallas, interpret mode) and its jnp twin against a float64
NumPy reference, with shuffled block tables, poisoned padding entries and poisoned pool rows; and `copy_rows`, which
fills the page cache that the paged kernel then reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.copy_rows import copy_rows
from pallas_kernels import paged_decode as paged_mod
from pallas_kernels.decode import decode_attention_with_lse
from pallas_kernels.paged_decode import (
    paged_decode_attention_kv_with_lse,
    paged_decode_attention_kv_with_lse_xla,
    paged_decode_attention_with_lse,
    paged_decode_attention_with_lse_xla,
)
from kernel_reference import assert_attention_close, decode_ref, rel_err

PAGED = {"pallas": paged_decode_attention_with_lse, "xla": paged_decode_attention_with_lse_xla}

# Padding entries of the block tables: out of range both ways (a read would fault on a GPU or
# clamp onto another page in interpret mode) or a real page that holds other keys or NaN.
_OUT_OF_RANGE = (-1, 2**30)

# (B, Hq, Hkv, D, page_size, max_pages, seq_lens, dtype, pallas kwargs). Lengths cover 0, 1,
# exact page boundaries, a full table and tails ending mid-page; each case mixes several
# features so the interpret-mode compiles stay few.
CASES = {
    "gqa4_f32_two_splits": (4, 8, 2, 64, 16, 5, [0, 1, 32, 71], "float32", dict(num_splits=2)),
    "gqa8_f32_d128_two_tiles_per_page": (2, 8, 1, 128, 64, 3, [64, 150], "float32",
                                         dict(block_k=32)),
    "gqa1_bf16_full_table": (3, 4, 4, 64, 16, 4, [17, 0, 64], "bfloat16", {}),
}


def _paged_inputs(seed, batch, hq, hkv, d, page_size, max_pages, seq_lens, dtype):
    """q, pools and tables (jax) plus float32 NumPy copies of what the kernel sees.

    Live pages come from one random permutation of the pool (no page shared); rows past
    seq_len in a tail page and the spare pages hold NaN, padding table entries point anywhere.
    """
    rng = np.random.default_rng(seed)
    live = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(live) + 3  # spare pages nobody owns
    order = iter(rng.permutation(num_pages))
    table = np.zeros((batch, max_pages), np.int64)
    pools = [np.full((num_pages, page_size, hkv, d), np.nan, np.float32) for _ in range(2)]
    for b, n in enumerate(seq_lens):
        for p in range(live[b]):
            table[b, p] = next(order)
            rows = min(page_size, n - p * page_size)
            for pool in pools:
                pool[table[b, p], :rows] = rng.standard_normal((rows, hkv, d))
    for b in range(batch):
        for p in range(live[b], max_pages):
            table[b, p] = rng.choice([*_OUT_OF_RANGE, rng.integers(num_pages)])
    q = jnp.asarray(rng.standard_normal((batch, hq, d)).astype(np.float32), dtype)
    k_pages, v_pages = (jnp.asarray(pool, dtype) for pool in pools)
    numpy = [np.asarray(x.astype(jnp.float32)) for x in (q, k_pages, v_pages)]
    return (q, k_pages, v_pages, jnp.asarray(table, jnp.int32),
            jnp.asarray(seq_lens, jnp.int32)), (*numpy, table)


def _gather_ref(pool, table, seq_lens):
    """[B, max_pages * page_size, Hkv, D] float64 keys in logical order; rows past seq_len are 0."""
    _, page_size, hkv, d = pool.shape
    batch, max_pages = table.shape
    live = np.arange(max_pages)[None, :] < -(-np.asarray(seq_lens)[:, None] // page_size)
    out = pool[np.where(live, table, 0)].astype(np.float64)
    out = out.reshape(batch, max_pages * page_size, hkv, d)
    out[np.arange(max_pages * page_size)[None, :] >= np.asarray(seq_lens)[:, None]] = 0.0
    return out


def _reference(numpy_inputs, seq_lens):
    qn, kn, vn, table = numpy_inputs
    return decode_ref(qn, _gather_ref(kn, table, seq_lens), _gather_ref(vn, table, seq_lens),
                      kv_len=seq_lens)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_decode_matches_float64(impl, case):
    b, hq, hkv, d, page_size, max_pages, seq_lens, dtype, kwargs = CASES[case]
    args, numpy_inputs = _paged_inputs(5000 + list(CASES).index(case) * 10 + (impl == "xla"),
                                       b, hq, hkv, d, page_size, max_pages, seq_lens, dtype)
    o, lse = PAGED[impl](*args, **(kwargs if impl == "pallas" else {}))
    assert o.dtype == args[0].dtype and o.shape == (b, hq, d)
    assert lse.dtype == jnp.float32 and lse.shape == (b, hq)
    ref_o, ref_lse = _reference(numpy_inputs, seq_lens)
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert_attention_close(o, lse, ref_o, ref_lse, tol=tol, lse_tol=max(1e-5, tol))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_combined_kv_pool_matches_float64(impl):
    """One pool with each page's keys and values side by side [num_pages, 2, page, Hkv, D] (the host
    store's layout) gives the float64 result, several pages per split and a tail mid-page."""
    b, hq, hkv, d, page_size, max_pages, seq_lens, dtype, kwargs = CASES["gqa4_f32_two_splits"]
    (q, k_pages, v_pages, table, lens), numpy_inputs = _paged_inputs(
        5050 + (impl == "xla"), b, hq, hkv, d, page_size, max_pages, seq_lens, dtype)
    kv_pages = jnp.stack([k_pages, v_pages], axis=1)
    fn = {"pallas": paged_decode_attention_kv_with_lse, "xla": paged_decode_attention_kv_with_lse_xla}[impl]
    o, lse = fn(q, kv_pages, table, lens, **(kwargs if impl == "pallas" else {}))
    ref_o, ref_lse = _reference(numpy_inputs, seq_lens)
    assert_attention_close(o, lse, ref_o, ref_lse, tol=1e-5, lse_tol=1e-5)
    if impl == "pallas":
        with pytest.raises(ValueError, match=r"allowed: \[num_pages, 2, page_size, Hkv, D\]"):
            fn(q, k_pages, table, lens)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_float32_output_is_the_unrounded_state(impl):
    """out_dtype=float32 rounded to bf16 is the default bf16 output bit for bit."""
    b, hq, hkv, d, page_size, max_pages, seq_lens, _, _ = CASES["gqa1_bf16_full_table"]
    args, numpy_inputs = _paged_inputs(5100, b, hq, hkv, d, page_size, max_pages, seq_lens,
                                       "bfloat16")
    o16, lse16 = PAGED[impl](*args)
    o32, lse32 = PAGED[impl](*args, out_dtype=jnp.float32)
    assert o16.dtype == jnp.bfloat16 and o32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o32.astype(jnp.bfloat16)), np.asarray(o16))
    np.testing.assert_array_equal(np.asarray(lse32), np.asarray(lse16))
    ref_o, ref_lse = _reference(numpy_inputs, seq_lens)
    assert_attention_close(o32, lse32, ref_o, ref_lse, tol=1e-2, lse_tol=1e-2)


def test_paged_equals_contiguous_decode():
    """The paged kernel gives the contiguous kernel's result on the same keys laid out in order."""
    b, hq, hkv, d, page_size, max_pages, seq_lens, _, kwargs = CASES["gqa4_f32_two_splits"]
    args, (qn, kn, vn, table) = _paged_inputs(5200, b, hq, hkv, d, page_size, max_pages,
                                              seq_lens, "float32")
    o, lse = paged_decode_attention_with_lse(*args, **kwargs)
    k, v = (jnp.asarray(_gather_ref(x, table, seq_lens), jnp.float32) for x in (kn, vn))
    o_c, lse_c = decode_attention_with_lse(args[0], k, v, kv_len=args[4], block_k=page_size,
                                           **kwargs)
    assert rel_err(o, o_c) <= 1e-6
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_c))
    finite = np.isfinite(np.asarray(lse_c))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_c)[finite], atol=1e-6)


def test_traced_tables_and_lengths_do_not_recompile():
    """New seq_lens / block_tables values reuse the compiled kernel, inside jit and called
    directly."""
    b, hq, hkv, d, page_size, max_pages, _, _, kwargs = CASES["gqa4_f32_two_splits"]
    traces = []

    @jax.jit
    def step(q, k_pages, v_pages, block_tables, seq_lens):
        traces.append(None)
        return paged_decode_attention_with_lse(q, k_pages, v_pages, block_tables, seq_lens,
                                               **kwargs)

    fast, _ = paged_mod._paged_decode_pallas.jitted
    sizes, shapes = [], []
    # Both rounds own 9 pages, so the pools have one shape and only values change.
    for seed, seq_lens in [(5300, [5, 80, 0, 48]), (5301, [33, 16, 64, 1])]:
        args, numpy_inputs = _paged_inputs(seed, b, hq, hkv, d, page_size, max_pages, seq_lens,
                                           "float32")
        shapes.append([x.shape for x in args])
        ref_o, ref_lse = _reference(numpy_inputs, seq_lens)
        for fn in (step, lambda *a: paged_decode_attention_with_lse(*a, **kwargs)):
            o, lse = fn(*args)
            assert_attention_close(o, lse, ref_o, ref_lse, tol=1e-5)
        sizes.append(fast._cache_size())
    assert shapes[0] == shapes[1]
    assert len(traces) == 1
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_rejects_bad_arguments(impl):
    fn = PAGED[impl]
    q = jnp.ones((2, 8, 64))
    pages = jnp.ones((6, 16, 2, 64))
    table = jnp.zeros((2, 3), jnp.int32)
    lens = jnp.asarray([3, 40], jnp.int32)
    with pytest.raises(ValueError, match="Hq=6 is not a multiple of Hkv=4"):
        fn(jnp.ones((2, 6, 64)), jnp.ones((6, 16, 4, 64)), jnp.ones((6, 16, 4, 64)), table, lens)
    with pytest.raises(ValueError, match="page_size=24"):
        fn(q, jnp.ones((6, 24, 2, 64)), jnp.ones((6, 24, 2, 64)), table, lens)
    with pytest.raises(ValueError, match="page_size=8"):
        fn(q, jnp.ones((6, 8, 2, 64)), jnp.ones((6, 8, 2, 64)), table, lens)
    with pytest.raises(ValueError, match="the same head_dim"):
        fn(jnp.ones((2, 8, 32)), pages, pages, table, lens)
    with pytest.raises(ValueError, match="allowed: equal shapes"):
        fn(q, pages, jnp.ones((5, 16, 2, 64)), table, lens)
    with pytest.raises(ValueError, match="allowed: one dtype"):
        fn(q, pages.astype(jnp.bfloat16), pages.astype(jnp.bfloat16), table, lens)
    with pytest.raises(ValueError, match="block_tables has shape"):
        fn(q, pages, pages, jnp.zeros((3, 3), jnp.int32), lens)
    with pytest.raises(ValueError, match="block_tables has dtype"):
        fn(q, pages, pages, table.astype(jnp.float32), lens)
    with pytest.raises(ValueError, match="seq_lens has shape"):
        fn(q, pages, pages, table, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="seq_lens has dtype"):
        fn(q, pages, pages, table, lens.astype(jnp.float32))
    with pytest.raises(ValueError, match="rank 3"):
        fn(q[None], pages, pages, table, lens)


def test_rejects_unsupported_head_dim_and_splits_in_pallas():
    q = jnp.ones((1, 2, 80))
    pages = jnp.ones((2, 16, 2, 80))
    with pytest.raises(ValueError, match="head_dim=80"):
        paged_decode_attention_with_lse(q, pages, pages, jnp.zeros((1, 2), jnp.int32), 5)
    q, pages = q[..., :64], pages[..., :64]
    with pytest.raises(ValueError, match="num_splits=0"):
        paged_decode_attention_with_lse(q, pages, pages, jnp.zeros((1, 2), jnp.int32), 5,
                                        num_splits=0)


def test_copy_rows_copies_kept_rows_and_skips_the_rest():
    """`copy_rows` (interpret mode) over an int8 pool with its float32 scales, as the page cache fills itself: kept
    entries land at their rows, the destination's other rows keep their values, and entries past the destination's
    rows are skipped (their source row, here poisoned with NaN, is never written anywhere)."""
    seed = 610
    rng = np.random.default_rng(seed)
    src_values = rng.integers(-128, 128, size=(12, 2, 16, 32), dtype=np.int8)
    src_scales = rng.random((12, 2, 16, 1), dtype=np.float32)
    src_scales[7] = np.nan
    dst_values = rng.integers(-128, 128, size=(5, 2, 16, 32), dtype=np.int8)
    dst_scales = rng.random((5, 2, 16, 1), dtype=np.float32)
    src_rows = np.array([3, 7, 11, 0, 7, 2], np.int32)
    dst_rows = np.array([4, 5, 0, 2, 2**30, 1], np.int32)  # 5 and 2**30: past the destination's rows
    out = jax.jit(copy_rows, donate_argnums=0)(
        (jnp.asarray(dst_values), jnp.asarray(dst_scales)), (jnp.asarray(src_values), jnp.asarray(src_scales)),
        jnp.asarray(src_rows), jnp.asarray(dst_rows))
    want_values, want_scales = dst_values.copy(), dst_scales.copy()
    for s, d in zip(src_rows, dst_rows):
        if d < 5:
            want_values[d], want_scales[d] = src_values[s], src_scales[s]
    np.testing.assert_array_equal(np.asarray(out[0]), want_values, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(out[1]), want_scales, err_msg=f"seed {seed}")
