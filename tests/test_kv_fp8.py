"""The 8-bit KV caches (`kv_cache_dtype="fp8"` and `"int8"`): the quantizers against float64 NumPy, the paged
decode kernels over an 8-bit pool with scales (Pallas interpret mode and the jnp twins), and the engine (tiny
Llama): offloaded equals in GPU memory, and with the page-choosing decode policies at full budget."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
import tiny_models
from jax_offload import LLM, SamplingParams
from jax_offload.kv import kv_cache_dtype as kvd
from kernel_reference import assert_attention_close, decode_ref

F8 = ml_dtypes.float8_e4m3fn
TOP = {"fp8": 448.0, "int8": 127.0}  # the largest value a row may reach


# ---- the quantizer -----------------------------------------------------------------------------------------------


def np_scales(x: np.ndarray, top: float) -> np.ndarray:
    """float64 [..., 1]: per row, the smallest power of two 2^k with max|x| / 2^k <= top, found by search on that
    definition (rows of zeros: nan, any scale does)."""
    amax = np.abs(x.astype(np.float64)).max(-1, keepdims=True)
    live = amax > 0
    k = np.where(live, np.floor(np.log2(np.where(live, amax, 1.0) / top)) - 3, 0.0)
    while True:
        too_small = live & (amax / 2.0**k > top)
        if not too_small.any():
            break
        k += too_small
    assert np.all(~live | (amax / 2.0 ** (k - 1) > top)), "not the smallest"  # the search started low enough
    return np.where(live, 2.0**k, np.nan)


def np_quantize(x: np.ndarray, fmt: str = "fp8") -> tuple[np.ndarray, np.ndarray]:
    """float64 reference: (float8_e4m3fn values, or int8 rounded half to even; float64 scales [..., 1]); zero rows
    get scale 1 (values 0)."""
    x = x.astype(np.float64)
    scales = np_scales(x, TOP[fmt])
    scales = np.where(np.isnan(scales), 1.0, scales)
    return ((x / scales).astype(F8) if fmt == "fp8" else np.round(x / scales).astype(np.int8)), scales


def _quantizer_inputs(seed: int, dtype) -> np.ndarray:
    """[rows, 64] float32 NumPy values exactly representable in `dtype`: rows of several magnitudes, incl. an all-zero
    row, 1e4 and 1e-6 rows, a row with one large outlier, and rows whose max sits on a power-of-two boundary."""
    rng = np.random.default_rng(seed)
    rows, d = 48, 64
    x = rng.standard_normal((rows, d)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    x[0] = 0.0
    x[1] = rng.standard_normal(d) * 1e4
    x[2] = rng.standard_normal(d) * 1e-6
    x[3, :] = 0.0
    x[3, 7] = -1e-6  # one tiny non-zero element
    for row, top in ((4, 448.0), (9, 127.0)):  # the formats' boundaries, fp8 then int8
        x[row] = rng.standard_normal(d)
        x[row, 5] = top  # max exactly the top: scale 1
        x[row + 1] = rng.standard_normal(d) * 1e-5
        x[row + 1, 9] = -top * 2.0**-20 * 1.0000001  # float32: just past top * 2^-20 (scale 2^-19); bf16: on it
        x[row + 2] = rng.standard_normal(d) * 1e-2
        x[row + 2, 0] = 3e3  # an outlier: the rest of the row falls into fp8's subnormals, int8's zeros
        x[row + 3] = np.full(d, top / 2 + 0.5)  # the max at the bottom of (top / 2, top]
    x[8] = rng.standard_normal(d) * 1e4
    x[8, :10] = 0.0
    x[13] = np.arange(d) - 0.5  # int8 at scale 1: every value but the max half way between two codes (to even)
    x[13, 0] = 100.0
    return np.asarray(jnp.asarray(x.astype(np.float32), dtype).astype(jnp.float32))


FORMATS = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantizer_matches_float64(fmt, dtype):
    seed = 9000 + (dtype == "bfloat16")
    where = f"seed {seed}, {fmt}, {dtype}"
    x32 = _quantizer_inputs(seed, dtype)
    x = jnp.asarray(x32, dtype)
    got = kvd.quantize(fmt, x)
    assert got.values.dtype == FORMATS[fmt] and got.scales.dtype == jnp.float32, where
    assert got.values.shape == x.shape and got.scales.shape == (*x.shape[:-1], 1), where
    values, scales = np.asarray(got.values), np.asarray(got.scales, np.float64)
    ref_values, ref_scales = np_quantize(x32, fmt)
    live = np.abs(x32).max(-1) > 0
    assert live.sum() == len(x32) - 1, where  # only row 0 is all zero
    np.testing.assert_array_equal(scales[live], ref_scales[live], err_msg=f"{where}: scales")
    # Rows of zeros: any positive power-of-two scale (a finite one), all values 0.
    zero_scales = scales[~live, 0]
    assert np.all((zero_scales > 0) & np.isfinite(zero_scales)), f"{where}: {zero_scales}"
    assert np.all(np.frexp(zero_scales)[0] == 0.5), f"{where}: zero rows' scale {zero_scales} not a power of two"
    assert np.all(values[~live].astype(np.float64) == 0.0), where
    # The values: x / scale rounded to nearest even (ml_dtypes and np.round from float64).
    np.testing.assert_array_equal(values[live].view(np.uint8), ref_values[live].view(np.uint8),
                                  err_msg=f"{where}: values (bits)")
    assert np.all(np.abs(values.astype(np.float64)) <= TOP[fmt]), where  # never saturated (fp8: to NaN)
    # Dequantize is exact: float64 values * scales, cast to the dtype, loses nothing.
    exact = values.astype(np.float64) * scales
    for out_dtype in ("float32", "bfloat16"):
        deq = np.asarray(kvd.dequantize(got, out_dtype).astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(deq, exact, err_msg=f"{where}: dequantize to {out_dtype}")
    # The round trip keeps x's dtype, and equals the exact dequantized values.
    rt = kvd.round_trip(fmt, x)
    assert rt.dtype == x.dtype, where
    np.testing.assert_array_equal(np.asarray(rt.astype(jnp.float32), np.float64), exact, err_msg=where)
    assert kvd.round_trip("auto", x) is x
    err = np.abs(exact - x32)
    row_max = np.abs(x32).max(-1, keepdims=True)
    if fmt == "int8":
        # Half a step (the scale) everywhere, and the scale is below max / 63.5: within 1/127 of the row's max.
        assert np.all(err <= scales / 2), where
        assert np.all(err <= row_max / 127), where
        return
    # fp8: at most half a step (2^-4 of |x|) where x / scale is a normal float8 (>= 2^-6), and within 2^-4 of the
    # row's max everywhere.
    normal = np.abs(x32) / np.where(live[:, None], scales, 1.0) >= 2.0**-6
    assert np.all(err[normal] <= 2.0**-4 * np.abs(x32)[normal]), where
    assert np.all(err <= 2.0**-4 * row_max), where
    assert normal[live].mean() > 0.5, where  # the bound above covers most elements


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_idempotent(fmt, dtype):
    seed = 9010 + (dtype == "bfloat16")
    where = f"seed {seed}, {fmt}, {dtype}"
    x = jnp.asarray(_quantizer_inputs(seed, dtype), dtype)
    once = kvd.round_trip(fmt, x)
    twice = kvd.round_trip(fmt, once)
    np.testing.assert_array_equal(np.asarray(twice.astype(jnp.float32)), np.asarray(once.astype(jnp.float32)),
                                  err_msg=where)
    # Also as the engine jits it.
    jitted = jax.jit(lambda y: kvd.round_trip(fmt, y))
    np.testing.assert_array_equal(np.asarray(jitted(once).astype(jnp.float32)),
                                  np.asarray(once.astype(jnp.float32)), err_msg=f"{where}, jit")


def test_encode_and_sizes():
    x = jnp.asarray(np.random.default_rng(9020).standard_normal((3, 5, 32)), jnp.float32)
    auto = kvd.encode("auto", x, jnp.bfloat16)
    assert auto.dtype == jnp.bfloat16 and auto.shape == x.shape
    fp8 = kvd.encode("fp8", x, jnp.bfloat16)
    assert isinstance(fp8, kvd.QuantizedKV)
    np.testing.assert_array_equal(np.asarray(kvd.dequantize(fp8, jnp.float32)), np.asarray(kvd.round_trip("fp8", x)))
    int8 = kvd.encode("int8", x, jnp.bfloat16)
    assert isinstance(int8, kvd.QuantizedKV) and int8.values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(kvd.dequantize(int8, jnp.float32)),
                                  np.asarray(kvd.round_trip("int8", x)))
    assert kvd.bytes_per_vector("fp8", 128, jnp.bfloat16) == kvd.bytes_per_vector("int8", 128, jnp.bfloat16) == 132
    assert kvd.bytes_per_vector("auto", 128, jnp.bfloat16) == 256
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is unknown; valid: auto, fp8, int8"):
        kvd.check_kv_cache_dtype("int4")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_packed_blocks_round_trip_bit_for_bit(fmt):
    """`pack` then `unpack` gives back every bit (any float8 byte, scales of 0, -0, inf, subnormals), and a
    "blocks" layer's packed block dequantizes to the bits of the same block kept as an `QuantizedKV` ("gpu" layer)."""
    from jax_offload.kv.host_store import HostKVStore
    from jax_offload.tensor_parallel import TensorParallel

    seed = 9030
    where = f"seed {seed}, {fmt}"
    carrier = jnp.uint8 if fmt == "fp8" else jnp.int8  # how unpack tells the formats apart
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, (3, 5, 64), dtype=np.uint8)
    scales = rng.integers(0, 2**32, (3, 5, 1), dtype=np.uint32)
    values[0, 0] = 0
    scales[0, :4, 0] = [0, 0x80000000, 0x7F800000, 1]  # 0, -0, inf, the smallest subnormal
    stored = kvd.QuantizedKV(jnp.asarray(values.view(FORMATS[fmt])), jnp.asarray(scales.view(np.float32)))
    packed = kvd.pack(stored)
    assert packed.dtype == carrier and packed.shape == (3, 5, 68), where
    back = kvd.unpack(packed)
    assert back.values.dtype == FORMATS[fmt], where
    np.testing.assert_array_equal(np.asarray(back.values).view(np.uint8), values, err_msg=where)
    np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint32), scales, err_msg=where)
    auto = jnp.ones((2, 3), jnp.bfloat16)
    assert kvd.pack(auto) is auto and kvd.unpack(auto) is auto and kvd.unpack(stored) is stored, where
    # The store: one "blocks" layer, one "gpu" layer, the same block (rows of zeros, 1e-6 and 1e4 included).
    kv = jnp.asarray(_quantizer_inputs(seed, "float32")[:32].reshape(2, 16, 1, 64))
    store = HostKVStore(2, 1, 16, 1, 64, jnp.float32, TensorParallel.create(1), places=["blocks", "gpu"],
                        kv_cache_dtype=fmt)
    assert store.host_bytes_held() == store.host_bytes == store.block_bytes == 2 * 16 * 68, where
    for layer in (0, 1):
        store.write(layer, 0, kvd.round_trip(fmt, kv))
    (block,), (pair,) = store.fetch([(0, 0)]), store.fetch([(1, 0)])
    assert block.dtype == carrier and isinstance(pair, kvd.QuantizedKV), where
    np.testing.assert_array_equal(np.asarray(kvd.dequantize(block, jnp.float32)).view(np.uint32),
                                  np.asarray(kvd.dequantize(pair, jnp.float32)).view(np.uint32), err_msg=where)
    np.testing.assert_array_equal(np.asarray(kvd.unpack(block).scales), np.asarray(pair.scales), err_msg=where)


# ---- the paged decode kernels over a float8 pool -----------------------------------------------------------------

# (B, Hq, Hkv, D, page_size, max_pages, seq_lens, q dtype, Pallas pool form, KV format). A partial tail page, an
# exact page boundary, an empty sequence, a single key. Each Pallas form runs with one q dtype and one format
# (interpret-mode compiles are the cost; the kernels' only format-dependent step is the load's cast); the jnp twins
# run both forms in both cases.
KERNEL_CASES = {
    "bf16_separate_fp8": (3, 4, 2, 64, 16, 5, [71, 0, 32], "bfloat16", "separate", "fp8"),
    "f32_combined_int8": (2, 8, 2, 32, 16, 4, [1, 53], "float32", "combined", "int8"),
}
_OUT_OF_RANGE = (-1, 2**30)


def _paged_inputs(seed, batch, hq, hkv, d, page_size, max_pages, seq_lens, dtype, fmt):
    """q, an 8-bit K and V pool with float32 scales [num_pages, page_size, Hkv, 1] (NumPy), shuffled block tables
    with poisoned padding entries; rows nobody owns hold NaN scales (and fp8 NaN values, int8 -128)."""
    rng = np.random.default_rng(seed)
    live = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(live) + 2
    order = iter(rng.permutation(num_pages))
    table = np.zeros((batch, max_pages), np.int64)
    pools = []
    for _ in range(2):
        x = rng.standard_normal((num_pages, page_size, hkv, d)) * 2.0 ** rng.uniform(-3, 3, (num_pages, page_size,
                                                                                            hkv, 1))
        values, scales = np_quantize(x, fmt)
        pools.append([values, scales.astype(np.float32), np.zeros(num_pages * page_size, bool).reshape(
            num_pages, page_size)])
    for b, n in enumerate(seq_lens):
        for p in range(live[b]):
            table[b, p] = next(order)
            for _, _, owned in pools:
                owned[table[b, p], :min(page_size, n - p * page_size)] = True
        for p in range(live[b], max_pages):
            table[b, p] = rng.choice([*_OUT_OF_RANGE, rng.integers(num_pages)])
    for values, scales, owned in pools:
        values[~owned] = np.nan if fmt == "fp8" else -128
        scales[~owned] = np.nan
    q = jnp.asarray(rng.standard_normal((batch, hq, d)).astype(np.float32), dtype)
    (kv, ks, _), (vv, vs, _) = pools
    return q, kv, ks, vv, vs, table.astype(np.int32), np.asarray(seq_lens, np.int32)


def _gather64(pool, table, seq_lens):
    """[B, max_pages * page_size, Hkv, D] float64 in logical order; rows past seq_len are 0."""
    _, page_size, hkv, d = pool.shape
    batch, max_pages = table.shape
    live = np.arange(max_pages)[None, :] < -(-seq_lens[:, None] // page_size)
    out = pool[np.where(live, table, 0)].astype(np.float64).reshape(batch, max_pages * page_size, hkv, d)
    out[np.arange(max_pages * page_size)[None, :] >= seq_lens[:, None]] = 0.0
    return out


def _reference64(q, kv, ks, vv, vs, table, lens):
    k = kv.astype(np.float64) * ks
    v = vv.astype(np.float64) * vs
    return decode_ref(np.asarray(q.astype(jnp.float32)), _gather64(k, table, lens), _gather64(v, table, lens),
                      kv_len=lens)


def _dequantized(values, scales, dtype):
    """The pool a dequantized cache in `dtype` holds (exact: float64 product, then cast)."""
    return jnp.asarray((values.astype(np.float64) * scales).astype(np.float32), dtype)


def _assert_bits_equal(a, b, what):
    for x, y, name in zip(a, b, ("o (or a state's acc)", "lse (or m)", "l")):
        np.testing.assert_array_equal(np.asarray(jnp.asarray(x).astype(jnp.float32)),
                                      np.asarray(jnp.asarray(y).astype(jnp.float32)), err_msg=f"{what}: {name}")


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_paged_kernels_over_8bit_pool(case):
    """An 8-bit pool (fp8 or int8) with scales, as separate K and V pools [num_pages, page, Hkv, D] or one K|V pool
    [num_pages, 2, page, Hkv, D] (scales [num_pages, 2, page, Hkv, 1]): the Pallas kernel gives the bits of the
    same kernel over the pool dequantized to q's dtype, and the float64 attention over the dequantized keys; so do
    the jnp twins (within tolerance)."""
    b, hq, hkv, d, page_size, max_pages, seq_lens, dtype, form, fmt = KERNEL_CASES[case]
    seed = 9100 + list(KERNEL_CASES).index(case)
    where = f"seed {seed}, {case}"
    q, kv, ks, vv, vs, table, lens = _paged_inputs(seed, b, hq, hkv, d, page_size, max_pages, seq_lens, dtype, fmt)
    ref_o, ref_lse = _reference64(q, kv, ks, vv, vs, table, lens)
    tol = dict(tol=1e-5, lse_tol=1e-5) if dtype == "float32" else dict(tol=1e-2, lse_tol=1e-2)
    kq, vq, kscale, vscale = (jnp.asarray(a) for a in (kv, vv, ks, vs))
    kd, vd = _dequantized(kv, ks, dtype), _dequantized(vv, vs, dtype)
    kvq, kv_scales = jnp.stack([kq, vq], axis=1), jnp.stack([kscale, vscale], axis=1)

    if form == "separate":
        quant = pk.paged_decode_attention_with_lse(q, kq, vq, table, lens, num_splits=2, k_scales=kscale,
                                                 v_scales=vscale)
        assert quant[0].dtype == q.dtype and quant[0].shape == (b, hq, d), where
        dequant = pk.paged_decode_attention_with_lse(q, kd, vd, table, lens, num_splits=2)
    else:
        quant = pk.paged_decode_attention_kv_with_lse(q, kvq, table, lens, kv_scales, num_splits=2)
        assert quant[0].dtype == q.dtype and quant[0].shape == (b, hq, d), where
        dequant = pk.paged_decode_attention_kv_with_lse(q, jnp.stack([kd, vd], axis=1), table, lens, num_splits=2)
    _assert_bits_equal(quant, dequant, f"{where}: Pallas over the {fmt} pool vs over the dequantized pool")
    assert_attention_close(*quant, ref_o, ref_lse, **tol)

    xla = pk.paged_decode_attention_with_lse_xla(q, kq, vq, table, lens, k_scales=kscale, v_scales=vscale)
    assert_attention_close(*xla, ref_o, ref_lse, **tol)
    xla_kv = pk.paged_decode_attention_kv_with_lse_xla(q, kvq, table, lens, kv_scales)
    assert_attention_close(*xla_kv, ref_o, ref_lse, **tol)


def test_paged_decode_state_over_fp8_pool():
    """The batch-invariant decode state over a float8 pool: the bits of the dequantized bfloat16 pool's."""
    b, hq, hkv, d, page_size, max_pages, seq_lens, dtype, _, fmt = KERNEL_CASES["bf16_separate_fp8"]
    seed = 9150
    q, kv, ks, vv, vs, table, lens = _paged_inputs(seed, b, hq, hkv, d, page_size, max_pages, seq_lens, dtype, fmt)
    empty = pk.empty_state(b, 1, hq, d)
    fp8 = pk.paged_decode_state(q, jnp.asarray(kv), jnp.asarray(vv), table, lens, empty, split_len=32,
                                k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
    dequant = pk.paged_decode_state(q, _dequantized(kv, ks, dtype), _dequantized(vv, vs, dtype), table, lens, empty,
                                    split_len=32)
    _assert_bits_equal(fp8, dequant, f"seed {seed}: decode state fp8 vs dequantized")
    # Folded in the attention kernel (a GPU's default where one program walks a sequence's splits): the scales are
    # read as by the split states' kernel; bits on a GPU, float32 rounding in the CPU interpreter.
    folded = pk.paged_decode_state(q, jnp.asarray(kv), jnp.asarray(vv), table, lens, empty, split_len=32,
                                   k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs), fold_in_kernel=True)
    if jax.default_backend() == "gpu":
        _assert_bits_equal(folded, fp8, f"seed {seed}: decode state fp8, folded in the kernel")
    else:
        for x, y in zip(folded, fp8):
            np.testing.assert_allclose(x, y, rtol=4e-6, atol=1e-6, err_msg=f"seed {seed}: folded in the kernel")
    o, lse = pk.finish_state(fp8)
    ref_o, ref_lse = _reference64(q, kv, ks, vv, vs, table, lens)
    assert_attention_close(o[:, 0], lse[..., 0], ref_o, ref_lse, tol=1e-2, lse_tol=1e-2)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_bad_scales_are_rejected(impl):
    fn = {"pallas": pk.paged_decode_attention_with_lse, "xla": pk.paged_decode_attention_with_lse_xla}[impl]
    kv_fn = {"pallas": pk.paged_decode_attention_kv_with_lse, "xla": pk.paged_decode_attention_kv_with_lse_xla}[impl]
    q = jnp.ones((2, 4, 32), jnp.bfloat16)
    pages = jnp.ones((3, 16, 2, 32), jnp.float8_e4m3fn)
    scales = jnp.ones((3, 16, 2, 1), jnp.float32)
    table, lens = jnp.zeros((2, 2), jnp.int32), jnp.asarray([3, 20], jnp.int32)
    with pytest.raises(ValueError, match="k_scales has shape .* and dtype bfloat16"):
        fn(q, pages, pages, table, lens, k_scales=scales.astype(jnp.bfloat16), v_scales=scales)
    with pytest.raises(ValueError, match=r"v_scales has shape \(3, 16, 2\)"):
        fn(q, pages, pages, table, lens, k_scales=scales, v_scales=scales[..., 0])
    with pytest.raises(ValueError, match=r"k_scales has shape \(3, 16, 2, 32\)"):
        fn(q, pages, pages, table, lens, k_scales=jnp.ones((3, 16, 2, 32)), v_scales=scales)
    with pytest.raises(ValueError, match="give both"):
        fn(q, pages, pages, table, lens, k_scales=scales)
    with pytest.raises(ValueError, match="k_pages has dtype bfloat16 with scales"):
        fn(q, pages.astype(jnp.bfloat16), pages.astype(jnp.bfloat16), table, lens, k_scales=scales, v_scales=scales)
    with pytest.raises(ValueError, match="allowed: one dtype"):  # a float8 pool without scales
        fn(q, pages, pages, table, lens)
    kv_pages = jnp.stack([pages, pages], axis=1)
    kv_scales = jnp.stack([scales, scales], axis=1)
    with pytest.raises(ValueError, match="kv_scales has shape|k_scales has shape"):
        kv_fn(q, kv_pages, table, lens, kv_scales[:, :, :8])
    with pytest.raises(ValueError, match="dtype bfloat16"):
        kv_fn(q, kv_pages, table, lens, kv_scales.astype(jnp.bfloat16))
    if impl == "pallas":
        with pytest.raises(ValueError, match="k_scales has shape"):
            pk.paged_decode_state(q, pages, pages, table, lens, pk.empty_state(2, 1, 4, 32),
                                  k_scales=scales[:, :8], v_scales=scales)


# ---- the engine ----------------------------------------------------------------------------------------------------

MODEL_SEED, PROMPT_SEED = 9201, 9202
PROMPT_LENGTHS = (5, 40, 100)
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
WHERE = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tiny_models.build_in(tmp_path_factory, "llama3", MODEL_SEED)
    rng = np.random.default_rng(PROMPT_SEED)
    return path, [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def float32_in_gpu(llama):
    """In-GPU fp8 float32: prefill logits and greedy tokens of each prompt, one at a time."""
    path, prompts = llama
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", max_model_len=MAX_LEN)
    return [llm.logits(p) for p in prompts], [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


# Chunked prefill here; layerwise prefill offloaded is in the bfloat16 test below (64-layerwise passed here too
# until the suite needed the time).
@pytest.mark.parametrize("block_size,num_ring_slots,prefill", [(16, 3, "chunked")])
def test_fp8_offloaded_equals_in_gpu_float32(llama, float32_in_gpu, block_size, num_ring_slots, prefill):
    path, prompts = llama
    logits, tokens = float32_in_gpu
    off = LLM(path, dtype="float32", kv_cache_dtype="fp8", max_model_len=MAX_LEN, offload=True,
              block_size=block_size, num_ring_slots=num_ring_slots, prefill=prefill)
    diff = max(float(np.abs(off.logits(p) - ref).max()) for p, ref in zip(prompts, logits))
    print(f"\nfp8 float32, block {block_size} {prefill}: max |dlogit| offloaded vs in GPU memory {diff}")
    assert diff <= 1e-5, f"{WHERE}, block {block_size} {prefill}: max |dlogit| {diff}"
    got = [off.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert got == tokens, f"{WHERE}, block {block_size} {prefill}: greedy differs"


def test_fp8_bfloat16_offloaded_equals_one_at_a_time(llama):
    path, prompts = llama
    prompts = prompts[::2]  # the shortest and the longest (all three until the suite needed the time)
    gpu = LLM(path, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=MAX_LEN, max_num_seqs=4)
    alone = [gpu.generate([p], GREEDY)[0].token_ids for p in prompts]
    # In GPU memory together passed too until the suite needed the time (last at 3db991e); on the CPU it holds by
    # margin, not by construction: alone is the one-request path, together the batch engine (issue 26).
    off = LLM(path, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=MAX_LEN, offload=True, block_size=64,
              prefill="layerwise")
    # Offloaded together (the offloaded batch engine attends each row as alone) passed too until the suite needed
    # the time; tests/tp_check.py runs fp8 offloaded under tensor parallelism.
    assert [off.generate([p], GREEDY)[0].token_ids for p in prompts] == alone, f"{WHERE}: offloaded"


def test_int8_bfloat16_offloaded_equals_in_gpu(llama):
    """int8 runs every path fp8 runs (the same `QuantizedKV` container, kernels and packing; only the quantizer and
    the load's cast differ): offloaded (layerwise prefill) gives the tokens of in GPU memory, one at a time."""
    path, prompts = llama
    prompts = prompts[::2]
    gpu = LLM(path, dtype="bfloat16", kv_cache_dtype="int8", max_model_len=MAX_LEN)
    alone = [gpu.generate([p], GREEDY)[0].token_ids for p in prompts]
    off = LLM(path, dtype="bfloat16", kv_cache_dtype="int8", max_model_len=MAX_LEN, offload=True, block_size=64,
              prefill="layerwise")
    assert [off.generate([p], GREEDY)[0].token_ids for p in prompts] == alone, f"{WHERE}: int8 offloaded"


# Quest reads its pages with the same `attend_rows` (only its scores differ, computed from the same fp8 keys);
# "quest" passed here too until the suite needed the time.
@pytest.mark.parametrize("policy", ["sketch"])
def test_fp8_page_policies_at_full_budget_equal_full_decode(llama, float32_in_gpu, policy):
    """A budget holding every page: the policy reads all of them, so the greedy tokens of full attention over the
    same fp8 keys (in GPU memory; offloaded full decode gives those too, above)."""
    path, prompts = llama
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", max_model_len=MAX_LEN, offload=True, block_size=32,
              decode_policy=policy, decode_budget=MAX_LEN, page_size=16, dense_layers=1)
    got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert got == float32_in_gpu[1], f"{WHERE}, {policy}"


# max |logit difference| fp8 vs auto (float32, in GPU memory, every prefill position) over the three prompts,
# measured when this test was written: 0.2385 (RMS 0.035 to 0.044, logits' RMS 0.8; bfloat16 weights and cache vs
# float32 differ by max 0.064 here). The bar is about three times it.
FP8_SHIFT_BOUND = 0.75


def test_fp8_changes_logits_by_a_bounded_amount(llama, float32_in_gpu):
    path, prompts = llama
    logits, _ = float32_in_gpu
    auto = LLM(path, dtype="float32", max_model_len=MAX_LEN)
    diff = max(float(np.abs(auto.logits(p) - ref).max()) for p, ref in zip(prompts, logits))
    print(f"\nfp8 vs auto, float32: max |dlogit| {diff}")
    assert diff > 0, f"{WHERE}: fp8 logits equal auto's; the KV cache is not quantized"
    assert diff <= FP8_SHIFT_BOUND, f"{WHERE}: max |dlogit| {diff}"


def test_unknown_kv_cache_dtype_is_one_clear_error(llama):
    path, _ = llama
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp16' is unknown; valid: auto, fp8, int8"):
        LLM(path, kv_cache_dtype="fp16")
