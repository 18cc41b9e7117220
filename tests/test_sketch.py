"""The key sketch of sketch decode against float64 NumPy: quantization, token scores, page mass."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import mgpu_sketch

from jax_offload.sparse import sketch

QMAX = {"int4": 7, "int8": 127}


def _np_quantize(k: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(k).max(-1) / QMAX[dtype]
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    return np.clip(np.round(k / safe), -QMAX[dtype], QMAX[dtype]), scale


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_quantization_and_packing_match_float64(dtype):
    seed = 4100 + len(dtype)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((3, 64, 32)).astype(np.float32) * rng.uniform(0.1, 5, (3, 64, 1)).astype(np.float32)
    k[1, 5] = 0.0  # a zero key: scale 0, codes 0
    codes, scale = sketch.quantize_keys(jnp.asarray(k), dtype)
    ref_codes, ref_scale = _np_quantize(k.astype(np.float64), dtype)
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-6, err_msg=f"seed {seed}")
    # float32 division can land a code one step off only where k / scale sits on a rounding boundary.
    assert np.mean(np.asarray(codes) != ref_codes) < 1e-3, f"seed {seed}"
    assert np.asarray(codes)[1, 5].tolist() == [0] * 32 and float(scale[1, 5]) == 0.0
    packed = sketch.pack_codes(codes, dtype)
    assert packed.shape[-1] == (16 if dtype == "int4" else 32)
    assert packed.dtype == (jnp.uint8 if dtype == "int4" else jnp.int8)
    np.testing.assert_array_equal(np.asarray(sketch.unpack_codes(packed, dtype)), np.asarray(codes))
    if dtype == "int4":  # byte j: channel j and channel j + D/2 as 4-bit two's complement (the Hopper kernel's view)
        c = np.asarray(codes).astype(np.uint8) & 0xF
        np.testing.assert_array_equal(np.asarray(packed), c[..., :16] | (c[..., 16:] << 4))
    err = np.abs(np.asarray(codes) * np.asarray(scale)[..., None] - k)
    assert np.all(err <= np.asarray(scale)[..., None] / 2 + 1e-6), f"seed {seed}: off by more than half a step"


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_token_scores_and_page_mass_match_float64(dtype):
    seed = 4200 + len(dtype)
    rng = np.random.default_rng(seed)
    hkv, g, t, d, page = 2, 3, 96, 32, 16
    q = rng.standard_normal((hkv, g, d)).astype(np.float32)
    k = rng.standard_normal((hkv, t, d)).astype(np.float32) * 2
    codes, scale = sketch.quantize_keys(jnp.asarray(k), dtype)
    scores = sketch.token_scores(jnp.asarray(q), sketch.pack_codes(codes, dtype), scale, dtype)
    c64, s64 = np.asarray(codes, np.float64), np.asarray(scale, np.float64)
    ref = np.einsum("hgd,htd->hgt", q.astype(np.float64), c64) * s64[:, None] / math.sqrt(d)
    np.testing.assert_allclose(np.asarray(scores), ref, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")

    num_pages = 4  # of 6: the last two hold no key yet
    num_keys = num_pages * page
    mass = np.asarray(sketch.page_mass(scores, jnp.int32(num_pages), page))
    e = np.exp(ref[..., :num_keys] - ref[..., :num_keys].max(-1, keepdims=True))
    p = np.zeros_like(ref)
    p[..., :num_keys] = e / e.sum(-1, keepdims=True)
    ref_mass = p.sum(1).reshape(hkv, t // page, page).sum(-1)
    np.testing.assert_allclose(mass, ref_mass, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    np.testing.assert_allclose(mass.sum(-1), g, rtol=1e-5)  # each query head's mass sums to 1
    assert np.all(mass[:, num_pages:] == 0)


def test_unknown_sketch_dtype_is_one_clear_error():
    with pytest.raises(ValueError, match="sketch_dtype 'int2' is unknown; valid: int4, int8"):
        sketch.quantize_keys(jnp.ones((2, 4)), "int2")


@pytest.mark.parametrize("dtype,pages,q_dtype,q_scale", [
    ("int4", 40, jnp.float32, 1.0), ("int8", 32, jnp.float32, 1.0), ("int4", 16, jnp.bfloat16, 1.0),
    ("int4", 16, jnp.bfloat16, 1e5)])
def test_pallas_page_lse_matches_float64(dtype, pages, q_dtype, q_scale):
    """The Pallas kernel (interpret mode here) against float64 NumPy over the unpacked codes; 40 pages leave a
    ragged last block of the kernel's 16-page tiles; int4 with a bfloat16 q takes the float16 bit-unpacking, with
    q scaled past float16's range. The jnp path of the engine computes the same, and so do 4 programs per page."""
    seed = 4300 + pages + (q_scale > 1)
    rng = np.random.default_rng(seed)
    hkv, g, d, page = 2, 3, 32, 16
    t = pages * page
    q = jnp.asarray(rng.standard_normal((hkv, g, d)) * q_scale, q_dtype)
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((hkv, t, d)) * 3, jnp.float32), dtype)
    packed = sketch.pack_codes(codes, dtype)
    stored = sketch.to_page_layout(packed, page), sketch.to_page_layout(scale, page)
    np.testing.assert_array_equal(np.asarray(sketch.from_page_layout(stored[0])), np.asarray(packed))
    got = pallas_kernels.sketch_page_lse(q, *stored, bits=int(dtype[3:]), block_p=16, interpret=True)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(d)).reshape(hkv, g, pages, page)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-6, atol=2e-6, err_msg=f"seed {seed}")
    jnp_path = sketch.page_lse(sketch.token_scores(q, packed, scale, dtype), page)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp_path), rtol=2e-6, atol=2e-6, err_msg=f"seed {seed}")
    first = pallas_kernels.sketch_page_lse(q, *stored, bits=int(dtype[3:]), num_pages=9, block_p=16, interpret=True)
    np.testing.assert_allclose(np.asarray(first), ref[..., :9], rtol=2e-6, atol=2e-6, err_msg=f"seed {seed}")
    # A page's offsets split over 4 programs, their log-sum-exps combined after.
    split = pallas_kernels.sketch_page_lse(q, *stored, bits=int(dtype[3:]), block_p=16, splits=4, interpret=True)
    np.testing.assert_allclose(np.asarray(split), ref, rtol=2e-6, atol=2e-6, err_msg=f"seed {seed}")


def test_hopper_kernel_lowers_for_cuda():
    """pallas_kernels/mgpu_sketch.py lowers for the GPU (the engine's shape, and a page of 4 with a group of 3); its
    values are checked against float64 on the GPU by bench/probes/probe_sketch_mgpu.py."""
    for hkv, g, page, p in ((8, 4, 16, 2048), (2, 3, 4, 128)):
        shapes = (jax.ShapeDtypeStruct((hkv, g, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((hkv, page, p, 64), jnp.uint8),
                  jax.ShapeDtypeStruct((hkv, page, p), jnp.float32))
        fn = functools.partial(mgpu_sketch.sketch_page_lse_mgpu, num_pages=p - 3)
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
