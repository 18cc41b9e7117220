"""attention_with_lse / decode_attention_with_lse (Pallas, interpret mode) and their jnp twins
against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import attention as attention_mod
from pallas_kernels._common import on_hopper
from kernel_reference import assert_attention_close, attention_ref, decode_ref

PREFILL = {"pallas": pk.attention_with_lse, "xla": pk.attention_with_lse_xla}
DECODE = {"pallas": pk.decode_attention_with_lse, "xla": pk.decode_attention_with_lse_xla}

# (B, Tq, Tk, Hq, Hkv, D, causal, q_offset, kv_len, dtype): lengths are not multiples of any
# block size; each case mixes several features so the interpret-mode compiles stay few.
PREFILL_CASES = {
    "gqa4_causal_offset_kvlen_d64": (2, 37, 53, 4, 1, 64, True, [16, 0], [53, 40], "float32"),
    "gqa8_tq1_noncausal_kvlen_d128": (2, 1, 70, 8, 1, 128, False, 0, [50, 17], "float32"),
    "gqa1_tk1_causal": (1, 19, 1, 2, 2, 64, True, 0, None, "float32"),
    "empty_rows_negative_offset_kvlen0": (3, 40, 100, 8, 2, 128, True, [60, -45, 5],
                                          [100, 100, 0], "float32"),
    "bf16_gqa8_causal": (1, 70, 130, 8, 1, 128, True, 60, None, "bfloat16"),
}


def _inputs(seed, q_shape, kv_shape, dtype):
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal(s).astype(np.float32) for s in (q_shape, kv_shape, kv_shape)]
    jarrs = [jnp.asarray(a, dtype) for a in arrs]
    # The reference sees exactly the (possibly bf16-rounded) values the kernel sees.
    return jarrs, [np.asarray(a.astype(jnp.float32)) for a in jarrs]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_float64(impl, case):
    b, tq, tk, hq, hkv, d, causal, q_offset, kv_len, dtype = PREFILL_CASES[case]
    seed = 1000 + list(PREFILL_CASES).index(case) * 10 + (impl == "xla")
    (q, k, v), (qn, kn, vn) = _inputs(seed, (b, tq, hq, d), (b, tk, hkv, d), dtype)
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=causal, q_offset=q_offset, kv_len=kv_len)
    o, lse = PREFILL[impl](q, k, v, causal=causal, q_offset=q_offset,
                           kv_len=None if kv_len is None else jnp.asarray(kv_len, jnp.int32))
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (b, hq, tq)
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert_attention_close(o, lse, ref_o, ref_lse, tol=tol, lse_tol=max(1e-5, tol))


@pytest.mark.parametrize("causal", [True, False])
def test_xla_twin_over_several_tiles_matches_float64(causal):
    """Lengths past the jnp twin's 512 x 512 tiles: the per-query-tile key loop must stop exactly
    at the diagonal and at kv_len, for offsets that hide whole tiles or all keys of a row."""
    b, tq, tk, hq, hkv, d = 2, 1100, 1300, 4, 2, 64
    q_offset, kv_len = [150, -700], [1300, 517]
    (q, k, v), (qn, kn, vn) = _inputs(3000 + causal, (b, tq, hq, d), (b, tk, hkv, d), "float32")
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=causal, q_offset=q_offset, kv_len=kv_len)
    o, lse = pk.attention_with_lse_xla(q, k, v, causal=causal, q_offset=jnp.asarray(q_offset),
                                       kv_len=jnp.asarray(kv_len))
    assert_attention_close(o, lse, ref_o, ref_lse, tol=1e-5, lse_tol=1e-5)


def _packed_starts(rng, batch, tq, longest):
    """kv_start of sequences of random lengths (1..longest) packed one after another in each row."""
    starts = np.zeros((batch, tq), np.int32)
    for b in range(batch):
        begin = 0
        while begin < tq:
            end = min(tq, begin + int(rng.integers(1, longest + 1)))
            starts[b, begin:end] = begin
            begin = end
    return starts


# (B, Tq, Tk, Hq, Hkv, D, causal, q_offset, kv_len, longest sequence, block_q, block_k): small Pallas blocks, so
# query blocks straddle sequences and keys below a block's first start are skipped.
PACKED_CASES = {
    "gqa4_causal_kvlen": (2, 150, 150, 4, 1, 64, True, 0, [150, 131], 40, 32, 16),
    "gqa2_noncausal_offset": (1, 97, 120, 4, 2, 64, False, 23, None, 70, 16, 32),
}


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_sequences_match_float64(impl, case):
    """kv_start: packed sequences (some rows also pushed past their own position, so they see no key), each
    query seeing only its own sequence's keys."""
    b, tq, tk, hq, hkv, d, causal, q_offset, kv_len, longest, block_q, block_k = PACKED_CASES[case]
    seed = 4000 + list(PACKED_CASES).index(case) * 10 + (impl == "xla")
    rng = np.random.default_rng(seed)
    (q, k, v), (qn, kn, vn) = _inputs(seed, (b, tq, hq, d), (b, tk, hkv, d), "float32")
    starts = _packed_starts(rng, b, tq, longest)
    starts[0, rng.choice(tq, 5, replace=False)] = tk  # rows that see nothing
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=causal, q_offset=q_offset, kv_len=kv_len, kv_start=starts)
    blocks = dict(block_q=block_q, block_k=block_k) if impl == "pallas" else {}
    o, lse = PREFILL[impl](q, k, v, causal=causal, q_offset=q_offset, kv_start=jnp.asarray(starts),
                           kv_len=None if kv_len is None else jnp.asarray(kv_len, jnp.int32), **blocks)
    assert_attention_close(o, lse, ref_o, ref_lse, tol=1e-5, lse_tol=1e-5)


def test_xla_twin_packed_sequence_gives_the_bits_of_its_own_call():
    """A sequence packed at a 16-aligned offset after others gives the bits of a call over it alone (what lets
    a packed prefill equal one-request prefill in float32)."""
    bounds = [0, 208, 256, 556]  # three sequences; the last starts at a multiple of 16
    (q, k, v), _ = _inputs(4101, (1, bounds[-1], 4, 64), (1, bounds[-1], 2, 64), "float32")
    starts = np.repeat(bounds[:-1], np.diff(bounds))[None].astype(np.int32)
    o, lse = pk.attention_with_lse_xla(q, k, v, causal=True, kv_start=jnp.asarray(starts))
    span = slice(bounds[2], bounds[3])
    alone_o, alone_lse = pk.attention_with_lse_xla(q[:, span], k[:, span], v[:, span], causal=True)
    np.testing.assert_array_equal(np.asarray(o[:, span]), np.asarray(alone_o))
    np.testing.assert_array_equal(np.asarray(lse[..., span]), np.asarray(alone_lse))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_picked_query_positions_match_float64(impl):
    """q_positions: queries picked from a longer sequence (CacheBlend's recomputed tokens), ascending with gaps,
    each seeing the keys up to its own position; small Pallas blocks, so query blocks skip key blocks past their
    last query and mask only the straddled ones."""
    seed = 4200 + (impl == "xla")
    rng = np.random.default_rng(seed)
    b, tq, tk, hq, hkv, d = 2, 45, 150, 4, 1, 64
    kv_len = [150, 97]
    positions = np.stack([np.sort(rng.choice(n, tq, replace=False)) for n in kv_len]).astype(np.int32)
    (q, k, v), (qn, kn, vn) = _inputs(seed, (b, tq, hq, d), (b, tk, hkv, d), "float32")
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=True, kv_len=kv_len, q_positions=positions)
    blocks = dict(block_q=16, block_k=16) if impl == "pallas" else {}
    o, lse = PREFILL[impl](q, k, v, causal=True, kv_len=jnp.asarray(kv_len, jnp.int32),
                           q_positions=jnp.asarray(positions), **blocks)
    assert_attention_close(o, lse, ref_o, ref_lse, tol=1e-5, lse_tol=1e-5)


@pytest.mark.parametrize("kernel", ["reversed_keys_cpu", "hopper_gpu"])
def test_picked_query_positions_on_the_hopper_route_match_float64(kernel, monkeypatch):
    """On the Hopper kernel, picked queries run over the keys reversed, each row seeing keys from tk-1-(its last
    visible key) on. `reversed_keys_cpu`: that route taken on the CPU (the reversed call then runs on the Triton
    kernel interpreted), float32; `hopper_gpu`: the real route on an sm_90 GPU, bf16."""
    if kernel == "hopper_gpu" and not on_hopper():
        pytest.skip("the Hopper kernel runs on sm_90 GPUs only")
    if kernel == "reversed_keys_cpu":  # the route's own check says yes; every later one (the reversed call's) no
        answers = iter([True])
        monkeypatch.setattr(attention_mod, "runs_on_hopper_kernel", lambda *args, **kwargs: next(answers, False))
    seed = 4210
    rng = np.random.default_rng(seed)
    b, tq, tk, hq, hkv, d = 2, 45, 150, 4, 1, 64
    kv_len = [150, 97]
    positions = np.stack([np.sort(rng.choice(n, tq, replace=False)) for n in kv_len]).astype(np.int32)
    dtype, tol = ("float32", 1e-5) if kernel == "reversed_keys_cpu" else ("bfloat16", 1e-2)
    (q, k, v), (qn, kn, vn) = _inputs(seed, (b, tq, hq, d), (b, tk, hkv, d), dtype)
    ref_o, ref_lse = attention_ref(qn, kn, vn, causal=True, kv_len=kv_len, q_positions=positions)
    o, lse = pk.attention_with_lse(q, k, v, causal=True, kv_len=jnp.asarray(kv_len, jnp.int32),
                                   q_positions=jnp.asarray(positions))
    assert_attention_close(o, lse, ref_o, ref_lse, tol=tol, lse_tol=tol)


def test_rejects_bad_kv_start():
    q = jnp.ones((1, 8, 2, 64))
    with pytest.raises(ValueError, match=r"kv_start has shape \(8,\); allowed: \(1, 8\)"):
        pk.attention_with_lse(q, q, q, kv_start=jnp.zeros(8, jnp.int32))
    with pytest.raises(ValueError, match="kv_start has dtype float32"):
        pk.attention_with_lse_xla(q, q, q, kv_start=jnp.zeros((1, 8)))


# (B, S, Hq, Hkv, D, kv_len, dtype, pallas kwargs)
DECODE_CASES = {
    "gqa8_kvlen_splits_d64": (3, 300, 8, 1, 64, [300, 0, 77], "float32",
                              dict(num_splits=5, block_k=32)),
    "gqa1_d128": (1, 37, 4, 4, 128, None, "float32", {}),
    "gqa4_s1": (2, 1, 12, 3, 64, None, "float32", {}),
    "bf16_gqa8": (1, 200, 16, 2, 128, 150, "bfloat16", {}),
}


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_float64(impl, case):
    b, s, hq, hkv, d, kv_len, dtype, kwargs = DECODE_CASES[case]
    seed = 2000 + list(DECODE_CASES).index(case) * 10 + (impl == "xla")
    (q, k, v), (qn, kn, vn) = _inputs(seed, (b, hq, d), (b, s, hkv, d), dtype)
    ref_o, ref_lse = decode_ref(qn, kn, vn, kv_len=kv_len)
    o, lse = DECODE[impl](q, k, v, kv_len=None if kv_len is None else jnp.asarray(kv_len),
                          **(kwargs if impl == "pallas" else {}))
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (b, hq)
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert_attention_close(o, lse, ref_o, ref_lse, tol=tol, lse_tol=max(1e-5, tol))


def test_traced_offset_and_length_do_not_recompile():
    """Inside jit (the engine) and called directly, new q_offset/kv_len values reuse the
    compiled kernel."""
    (q, k, v), (qn, kn, vn) = _inputs(11, (1, 24, 4, 64), (1, 48, 2, 64), "float32")
    traces = []

    @jax.jit
    def step(q, k, v, q_offset, kv_len):
        traces.append(None)
        return pk.attention_with_lse(q, k, v, causal=True, q_offset=q_offset, kv_len=kv_len)

    for q_offset, kv_len in [(0, 48), (20, 30), (-30, 48)]:
        o, lse = step(q, k, v, jnp.int32(q_offset), jnp.int32(kv_len))
        ref_o, ref_lse = attention_ref(qn, kn, vn, causal=True, q_offset=q_offset,
                                       kv_len=kv_len)
        assert_attention_close(o, lse, ref_o, ref_lse, tol=1e-5)
    assert len(traces) == 1

    fast, _ = attention_mod._attention_pallas.jitted
    pk.attention_with_lse(q, k, v, causal=True, q_offset=3, kv_len=40, interpret=True)
    size = fast._cache_size()
    pk.attention_with_lse(q, k, v, causal=True, q_offset=17, kv_len=21, interpret=True)
    assert fast._cache_size() == size


@pytest.mark.parametrize("fn", [pk.attention_with_lse, pk.attention_with_lse_xla])
def test_rejects_bad_shapes(fn):
    q = jnp.ones((1, 4, 6, 64))
    k = jnp.ones((1, 8, 4, 64))
    with pytest.raises(ValueError, match="Hq=6 is not a multiple of Hkv=4"):
        fn(q, k, k)
    with pytest.raises(ValueError, match="same batch and head_dim"):
        fn(jnp.ones((1, 4, 4, 32)), k, k)
    with pytest.raises(ValueError, match="kv_len has shape"):
        fn(jnp.ones((1, 4, 4, 64)), k, k, kv_len=jnp.ones((3,), jnp.int32))


def test_rejects_unsupported_head_dim_in_pallas():
    q = jnp.ones((1, 4, 2, 80))
    with pytest.raises(ValueError, match="head_dim=80"):
        pk.attention_with_lse(q, q, q)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_float32_output_is_the_unrounded_state(impl):
    """out_dtype=float32 returns the accumulator that the default output rounds to bf16: rounding
    it gives the default output bit for bit, and it sits closer to the float64 reference."""
    (q, k, v), (qn, kn, vn) = _inputs(4000, (1, 70, 8, 64), (1, 130, 2, 64), "bfloat16")
    ref_o, _ = attention_ref(qn, kn, vn, causal=True, q_offset=60)
    o16, lse16 = PREFILL[impl](q, k, v, causal=True, q_offset=60)
    o32, lse32 = PREFILL[impl](q, k, v, causal=True, q_offset=60, out_dtype=jnp.float32)
    assert o32.dtype == jnp.float32 and o16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(o32.astype(jnp.bfloat16)), np.asarray(o16))
    np.testing.assert_array_equal(np.asarray(lse32), np.asarray(lse16))
    err16 = np.abs(np.asarray(o16, np.float64) - ref_o).max()
    err32 = np.abs(np.asarray(o32, np.float64) - ref_o).max()
    assert err32 < err16, (err32, err16)

    (q, k, v), (qn, kn, vn) = _inputs(4001, (2, 8, 64), (2, 200, 2, 64), "bfloat16")
    d16, _ = DECODE[impl](q, k, v, kv_len=jnp.asarray([200, 91]))
    d32, _ = DECODE[impl](q, k, v, kv_len=jnp.asarray([200, 91]), out_dtype=jnp.float32)
    assert d32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(d32.astype(jnp.bfloat16)), np.asarray(d16))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_state_streamed_in_blocks_gives_the_bits_of_one_call(impl):
    """A chunk of queries attending earlier key blocks one call at a time (the raw state carried between
    calls), then its own keys causally, gives exactly the rows one causal call over all keys gives."""
    (q, k, v), _ = _inputs(4100, (1, 256, 4, 64), (1, 256, 2, 64), "bfloat16")
    if impl == "pallas":
        state_fn, finish_fn, tiles = pk.attention_state, pk.attention_with_lse, dict(block_q=64, block_k=32)
    else:
        state_fn, finish_fn, tiles = pk.attention_state_xla, pk.attention_with_lse_xla, {}
    whole, whole_lse = finish_fn(q, k, v, causal=True, out_dtype=jnp.float32, **tiles)
    chunk = slice(128, 256)
    state = None
    for b in (slice(0, 64), slice(64, 128)):  # earlier blocks, ascending, all visible
        state = state_fn(q[:, chunk], k[:, b], v[:, b], state, **tiles)
    o, lse = finish_fn(q[:, chunk], k[:, chunk], v[:, chunk], causal=True, state=state, out_dtype=jnp.float32,
                       **tiles)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(whole[:, chunk]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(whole_lse[..., chunk]))


def test_decode_state_over_keys_in_pieces_gives_the_bits_of_one_call():
    """The engine's decode: keys arriving as blocks of a multiple of the split (1,024 keys here), then a partial
    tail, continue the float32 state to the very bits of one call over the whole (longer, padded) cache; and the
    result is attention within bf16 tolerance of float64. (Splits set by the whole length:
    `test_paged_decode_splits_by_each_sequences_length`.)"""
    split = 1024
    (q, k, v), (qn, kn, vn) = _inputs(4200, (2, 8, 64), (2, 4 * split, 2, 64), "bfloat16")
    kv_len = 3 * split + 37
    empty = pk.empty_state(2, 1, 8, 64)
    whole = pk.decode_state(q, k, v, empty, kv_len=kv_len, split_len=split)
    state = empty
    for block in (slice(0, 2 * split), slice(2 * split, 3 * split)):
        state = pk.decode_state(q, k[:, block], v[:, block], state, split_len=split)
    tail = slice(3 * split, 4 * split)
    state = pk.decode_state(q, k[:, tail], v[:, tail], state, kv_len=kv_len - 3 * split, split_len=split)
    for got, want in zip(state, whole):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg="seed 4200")
    o, lse = pk.finish_state(whole)
    ref_o, ref_lse = decode_ref(qn, kn, vn, kv_len=kv_len)
    assert_attention_close(o[:, 0], lse[..., 0], ref_o, ref_lse, tol=2e-2)
