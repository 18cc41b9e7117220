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
from jax_offload.tensor_parallel import TensorParallel

QMAX = {"int4": 7, "int8": 127}


def _np_quantize(k: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(k).max(-1) / QMAX[dtype]
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    return np.clip(np.round(k / safe), -QMAX[dtype], QMAX[dtype]), scale


@pytest.mark.parametrize("dtype,words", [("int4", False), ("int4", True), ("int8", False)])
def test_quantization_and_packing_match_float64(dtype, words):
    seed = 4100 + len(dtype) + words
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((3, 64, 32)).astype(np.float32) * rng.uniform(0.1, 5, (3, 64, 1)).astype(np.float32)
    k[1, 5] = 0.0  # a zero key: scale 0, codes 0
    codes, scale = sketch.quantize_keys(jnp.asarray(k), dtype)
    ref_codes, ref_scale = _np_quantize(k.astype(np.float64), dtype)
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-6, err_msg=f"seed {seed}")
    # float32 division can land a code one step off only where k / scale sits on a rounding boundary.
    assert np.mean(np.asarray(codes) != ref_codes) < 1e-3, f"seed {seed}"
    assert np.asarray(codes)[1, 5].tolist() == [0] * 32 and float(scale[1, 5]) == 0.0
    packed = sketch.pack_codes(codes, dtype, words)
    width, stored_dtype = {(False, "int8"): (32, jnp.int8), (False, "int4"): (16, jnp.uint8),
                           (True, "int4"): (4, jnp.uint32)}[words, dtype]
    assert packed.shape[-1] == width and packed.dtype == stored_dtype
    np.testing.assert_array_equal(np.asarray(sketch.unpack_codes(packed, dtype)), np.asarray(codes))
    c = np.asarray(codes)
    if dtype == "int4" and not words:  # byte j: channel j and channel j + D/2 as 4-bit two's complement
        nibbles = c.astype(np.uint8) & 0xF
        np.testing.assert_array_equal(np.asarray(packed), nibbles[..., :16] | (nibbles[..., 16:] << 4))
    if words:  # word w rotated right by 4i and masked: channel 4w + i at bits 0-2 (sign 15), D/2 + 4w + i at 16-18
        w = np.asarray(packed).astype(np.uint64)  # (sign 31), sign-magnitude
        for i in range(4):
            pair = ((w >> (4 * i)) | (w << (32 - 4 * i))) & 0x80078007
            for half, bits in enumerate((pair, pair >> 16)):
                value = (bits & 7).astype(np.int64) * np.where(bits & 0x8000, -1, 1)
                np.testing.assert_array_equal(value, c.reshape(3, 64, 2, 4, 4)[..., half, :, i],
                                              err_msg=f"seed {seed}, pair {i}")
    err = np.abs(c * np.asarray(scale)[..., None] - k)
    assert np.all(err <= np.asarray(scale)[..., None] / 2 + 1e-6), f"seed {seed}: off by more than half a step"


def test_key_sketch_records_int4_words():
    """The sketch the engine keeps for the Hopper kernel (int4 words) holds a written block's quantized keys in the
    page layout, as the byte layout does."""
    seed = 4150
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.standard_normal((2, 32, 2, 128)), jnp.float32)  # [K|V, block, Hkv, D]
    stores = {words: sketch.KeySketch([1], 96, 2, 128, 16, "int4", TensorParallel.create(1), words=words)
              for words in (False, True)}
    codes, _ = sketch.quantize_keys(kv[0].transpose(1, 0, 2), "int4")
    for words, store in stores.items():
        store.record(1, 1, kv)  # block 1: tokens 32..63, pages 2 and 3
        assert store.codes[1].dtype == (jnp.uint32 if words else jnp.uint8), words
        kept = sketch.unpack_codes(sketch.from_page_layout(store.codes[1])[:, 32:64], "int4")
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(codes), err_msg=f"seed {seed}, words {words}")
        assert not np.asarray(store.codes[1][:, :, :2]).any()


@pytest.mark.parametrize("dtype,words", [("int4", False), ("int4", True), ("int8", False)])
def test_token_scores_and_page_mass_match_float64(dtype, words):
    seed = 4200 + len(dtype) + words
    rng = np.random.default_rng(seed)
    hkv, g, t, d, page = 2, 3, 96, 32, 16
    q = rng.standard_normal((hkv, g, d)).astype(np.float32)
    k = rng.standard_normal((hkv, t, d)).astype(np.float32) * 2
    codes, scale = sketch.quantize_keys(jnp.asarray(k), dtype)
    scores = sketch.token_scores(jnp.asarray(q), sketch.pack_codes(codes, dtype, words), scale, dtype)
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


def test_int4_words_off_hopper_are_one_clear_error():
    q = jnp.ones((2, 4, 128), jnp.bfloat16)
    words = jnp.zeros((2, 16, 8, 16), jnp.uint32)
    with pytest.raises(ValueError, match=r"int4 words \(codes \(2, 16, 8, 16\) uint32\) are scored by the Hopper"):
        pallas_kernels.sketch_page_lse(q, words, jnp.ones((2, 16, 8)), bits=4, interpret=True)


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
    values were checked against float64 on an H100 (bench/results/runs/h100_sketch_mgpu/; the probe is deleted, its
    last commit in bench/probes/README.md)."""
    for hkv, g, page, p in ((8, 4, 16, 2048), (2, 3, 4, 128)):
        shapes = (jax.ShapeDtypeStruct((hkv, g, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((hkv, page, p, 16), jnp.uint32),
                  jax.ShapeDtypeStruct((hkv, page, p), jnp.float32))
        fn = functools.partial(mgpu_sketch.sketch_page_lse_mgpu, num_pages=p - 3)
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    # Three requests' sketches end to end, 128 pages each, in one launch.
    shapes = (jax.ShapeDtypeStruct((3, 8, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((8, 16, 384, 16), jnp.uint32),
              jax.ShapeDtypeStruct((8, 16, 384), jnp.float32))
    fn = functools.partial(mgpu_sketch.sketch_page_lse_requests_mgpu, num_pages=128)
    jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    # The same requests' tiles read where they lie in a larger store's sketch.
    shapes = (shapes[0], jax.ShapeDtypeStruct((8, 16, 1024, 16), jnp.uint32),
              jax.ShapeDtypeStruct((8, 16, 1024), jnp.float32), jax.ShapeDtypeStruct((6,), jnp.int32))
    def scattered(q, codes, scales, tile_starts):
        return mgpu_sketch.sketch_page_lse_requests_mgpu(q, codes, scales, num_pages=128, tile_starts=tile_starts)

    jax.jit(scattered).trace(*shapes).lower(lowering_platforms=("cuda",))


def test_requests_end_to_end_score_each_as_alone():
    """`sketch_page_lse_requests`: three requests' sketches laid end to end on the page axis, scored in one call,
    give each request's page log-sum-exps of `sketch_page_lse` alone, bit for bit: int4 words in one Hopper launch
    on an H100/H200 (tiles of 64 pages, each one request's), int4 bytes in interpret mode elsewhere. So do their
    64-page tiles scattered over a larger store's sketch and named by `tile_starts` (read where they lie on
    Hopper, gathered first elsewhere)."""
    seed = 4390
    rng = np.random.default_rng(seed)
    requests, hkv, g, d, page, pages = 3, 2, 3, 128, 16, 128
    q = jnp.asarray(rng.standard_normal((requests, hkv, g, d)), jnp.bfloat16)
    words = mgpu_sketch.is_supported(q[0], jnp.zeros((hkv, page, pages, d // 8), jnp.uint32))
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((hkv, requests * pages * page, d)) * 3,
                                                    jnp.float32), "int4")
    stored = (sketch.to_page_layout(sketch.pack_codes(codes, "int4", words), page),
              sketch.to_page_layout(scale, page))
    interpret = None if words else True
    together = pallas_kernels.sketch_page_lse_requests(q, *stored, bits=4, num_pages=pages, interpret=interpret)
    for r in range(requests):
        own = (x[:, :, r * pages:(r + 1) * pages] for x in stored)
        alone = pallas_kernels.sketch_page_lse(q[r], *own, bits=4, interpret=interpret)
        np.testing.assert_array_equal(np.asarray(together[r]), np.asarray(alone), err_msg=f"seed {seed}, request {r}")
    tile, tiles = pallas_kernels.SKETCH_TILE_PAGES, requests * pages // pallas_kernels.SKETCH_TILE_PAGES
    slots = rng.permutation(2 * tiles)[:tiles]  # where each tile lies in a store twice as large
    store = tuple(jnp.zeros((*x.shape[:2], 2 * tiles * tile, *x.shape[3:]), x.dtype)
                  .reshape(*x.shape[:2], 2 * tiles, tile, *x.shape[3:])
                  .at[:, :, slots].set(x.reshape(*x.shape[:2], tiles, tile, *x.shape[3:]))
                  .reshape(*x.shape[:2], 2 * tiles * tile, *x.shape[3:]) for x in stored)
    scattered = pallas_kernels.sketch_page_lse_requests(q, *store, bits=4, num_pages=pages, interpret=interpret,
                                                        tile_starts=jnp.asarray(slots * tile, jnp.int32))
    np.testing.assert_array_equal(np.asarray(scattered), np.asarray(together), err_msg=f"seed {seed}, tiles {slots}")


@pytest.mark.parametrize("block_pages", [128, 32])
def test_requests_page_scores_read_store_blocks_as_each_alone(block_pages):
    """`SketchScore.requests_page_scores` (Pallas) of two requests whose pages lie in store blocks out of order:
    each request's rows equal its scores alone over its gathered pages (`scores_each`), bit for bit, whether its
    64-page tiles are read where they lie (blocks of 128 pages) or its runs are gathered first (blocks of 32). On
    an H100/H200 the sketch is int4 words, scored by the Hopper kernel."""
    seed = 4391
    rng = np.random.default_rng(seed)
    hkv, g, d, page, store_pages, candidates = 2, 2, 128, 16, 512, 256
    q = jnp.asarray(rng.standard_normal((2, hkv * g, d)), jnp.bfloat16)
    words = mgpu_sketch.is_supported(q[0].reshape(hkv, g, d), jnp.zeros((hkv, page, store_pages, d // 8), jnp.uint32))
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((hkv, store_pages * page, d)) * 3,
                                                    jnp.float32), "int4")
    meta = (sketch.to_page_layout(sketch.pack_codes(codes, "int4", words), page), sketch.to_page_layout(scale, page))
    blocks = rng.permutation(store_pages // block_pages)

    def table(first_block, n):  # n pages in whole store blocks taken from `blocks`, then page 0
        used = -(-n // block_pages)
        pages = np.concatenate([np.arange(b * block_pages, (b + 1) * block_pages)
                                for b in blocks[first_block:first_block + used]])
        return jnp.asarray(np.pad(pages, (0, candidates - len(pages))), jnp.int32), used

    t0, used = table(0, 100)
    t1, _ = table(used, 200)
    scorer = sketch.SketchScore("int4", page)
    num_pages = (jnp.int32(100), jnp.int32(200))
    together = scorer.requests_page_scores("pallas", q, meta, (t0, t1), num_pages, candidates, block_pages)
    alone = sketch.scores_each(scorer, "pallas", q, meta, (t0, t1), num_pages, candidates)
    np.testing.assert_array_equal(np.asarray(together), np.asarray(alone),
                                  err_msg=f"seed {seed}, block_pages {block_pages}, blocks {blocks}, words {words}")
