"""The warpgroup-MMA form of the batch-invariant matmul, pallas_kernels/mgpu_matmul.py: the bits of the Triton form
(pallas_kernels/matmul.py) in Mosaic GPU's CPU interpreter (two chunks of K, rows padded to the row tile), lowering
for CUDA at the 8B shapes it is for, and on a Hopper GPU the bits of the Triton form at prefill and decode-batch
sizes.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import on_hopper
from pallas_kernels.matmul import matmul
from pallas_kernels.mgpu_matmul import mgpu_matmul


pytestmark = pytest.mark.usefixtures("unoptimised_compiles")


def _inputs(seed: int, m: int, k: int, n: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16)
    return x, w


def _same_bits(a, b) -> bool:
    return bool(jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16) == jax.lax.bitcast_convert_type(b, jnp.uint16)))


@pytest.mark.parametrize("m,k,one_pass", [(70, 2048, True), (130, 4096, False)])
def test_interpreted_gives_the_bits_of_the_triton_form(monkeypatch, m, k, one_pass):
    """Two column tiles of CTAs of two 64-row warpgroup tiles (rows padded): 70 rows with K in one pass, or 130 rows
    (two row tiles) with K's four 1,024-key chunks in two groups (GROUPED_CHUNKS lowered to 4 here: a CTA a group, two
    chunks each), bf16: bit for bit the Triton form's output, and within bf16 rounding of float64."""
    seed = int(np.random.default_rng().integers(2**31))
    x, w = _inputs(seed, m, k, 128)
    with monkeypatch.context() as patch:
        if not one_pass:
            patch.setattr(sys.modules["pallas_kernels.matmul"], "GROUPED_CHUNKS", 4)
        jax.clear_caches()  # read as programs are traced: none traced before may answer, none traced here may stay
        got = mgpu_matmul(x, w, tile_m=64, tile_n=64, split_rows=True, steps=2, one_pass=one_pass, interpret=True)
        want = matmul(x, w, one_pass=one_pass, interpret=True)
    jax.clear_caches()
    assert _same_bits(got, want), f"seed {seed}: bits differ from the Triton form's"
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-2, atol=1e-2, err_msg=f"seed {seed}")


def test_lowers_for_cuda():
    """The 8B shapes it serves (a 14,336-deep w_down at prefill size, the wide w_gate_up at 256 rows, a padded row
    count, a float32 product as tensor parallelism's w_down shard makes) at both arrangements of a CTA's two tiles,
    in cluster pairs, and in one pass with prefill's 128 x 128 tiles (a ring of 4 slots; 3 beside float32 output
    slots; one above the other where N is no multiple of 256) and a wide weight's 64 x 256 decode tiles, lower to
    Mosaic GPU kernels that fit shared memory, on this CPU-only machine (the lowering and layout inference the GPU
    build runs; the interpreter skips them)."""
    for m, k, n, tiles in [(8192, 14336, 4096, dict(tile_m=64, tile_n=128, split_rows=True)),
                           (8192, 7168, 4096, dict(tile_m=64, tile_n=128, split_rows=True, out_dtype=jnp.float32)),
                           (256, 4096, 28672, dict(tile_m=128, tile_n=64, split_rows=False, steps=6)),
                           (100, 4096, 6144, dict(tile_m=64, tile_n=128, split_rows=False)),
                           (256, 14336, 4096, dict(tile_m=64, tile_n=64, split_rows=False)),
                           (8192, 14336, 4096, dict(tile_m=64, tile_n=128, split_rows=True, cluster="m")),
                           (8192, 14336, 4096, dict(tile_m=128, tile_n=128, split_rows=False, one_pass=True)),
                           (8192, 7168, 2048, dict(tile_m=128, tile_n=128, split_rows=False, one_pass=True,
                                                   out_dtype=jnp.float32)),
                           (1024, 4096, 1152, dict(tile_m=128, tile_n=128, split_rows=True, one_pass=True)),
                           (128, 4096, 28672, dict(tile_m=64, tile_n=256, split_rows=True))]:
        x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        try:
            jax.jit(lambda x, w, tiles=tiles: mgpu_matmul(x, w, **tiles)).trace(x, w).lower(
                lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"M={m} K={k} N={n} {tiles}: {type(e).__name__}: {str(e)[-400:]}") from None


@pytest.mark.skipif(not on_hopper(), reason="needs a Hopper GPU (wgmma)")
def test_gives_the_bits_of_the_triton_form_on_hopper(monkeypatch):
    """On the GPU, against the compiled Triton form: decode-batch and prefill row counts (one not a multiple of
    the row tile), deep and wide weights, every tile config."""
    monkeypatch.setenv("JAX_OFFLOAD_HOPPER_MATMUL", "0")  # `matmul` the Triton form, which Hopper would route
    seed = int(np.random.default_rng().integers(2**31))
    for k, n in [(4096, 6144), (14336, 4096), (4096, 28672)]:
        for m in (64, 256, 1000, 4096):
            x, w = _inputs(seed + m, m, k, n)
            ref = matmul(x, w)
            for tiles in [dict(tile_m=64, tile_n=128, split_rows=True), dict(tile_m=128, tile_n=64, split_rows=False),
                          dict(tile_m=64, tile_n=128, split_rows=False), dict(tile_m=64, tile_n=64, split_rows=False),
                          dict(tile_m=64, tile_n=128, split_rows=True, cluster="m"),
                          dict(tile_m=128, tile_n=64, split_rows=False, cluster="n")]:
                got = mgpu_matmul(x, w, **tiles)
                assert _same_bits(got, ref), f"seed {seed + m}: M={m} K={k} N={n} {tiles} differ from the Triton form"
            one_pass = matmul(x, w, one_pass=True)
            for tiles in [dict(tile_m=128, tile_n=128, split_rows=False), dict(tile_m=128, tile_n=128, split_rows=True),
                          dict(tile_m=64, tile_n=128, split_rows=True), dict(tile_m=64, tile_n=64, split_rows=False),
                          dict(tile_m=64, tile_n=256, split_rows=True), dict(tile_m=64, tile_n=128, split_rows=False)]:
                got = mgpu_matmul(x, w, one_pass=True, **tiles)
                assert _same_bits(got, one_pass), \
                    f"seed {seed + m}: M={m} K={k} N={n} {tiles} in one pass differ from the Triton form"


def test_matmul_routes_to_the_warpgroup_form_on_hopper(monkeypatch):
    """On Hopper `matmul.matmul` takes the warpgroup form at prefill sizes and for decode batches of 64+ rows against
    wide weights or a K whose chunks add in groups, 128+ against large ones or 256+ against deep ones, untransposed,
    bf16, with no launch parameter given, in CTAs of 64 rows where they fit one wave (wide weights: the one-pass
    tiles); the Triton form otherwise, and always with JAX_OFFLOAD_HOPPER_MATMUL=0. The device check and both
    kernels are stubbed (recorders)."""
    mm = sys.modules["pallas_kernels.matmul"]  # the package's `matmul` is the function
    mgm = sys.modules["pallas_kernels.mgpu_matmul"]

    calls, tiles = [], []

    def recorder(name):
        def run(x, w, transpose_w=False, **kw):
            calls.append(name)
            tiles.append({key: kw[key] for key in ("tile_m", "tile_n", "split_rows", "one_pass") if key in kw})
            return jnp.zeros((x.shape[0], w.shape[0] if transpose_w else w.shape[1]), x.dtype)
        return run

    monkeypatch.setattr(mm, "on_hopper", lambda: True)
    monkeypatch.setattr(mgm, "mgpu_matmul", recorder("wgmma"))
    monkeypatch.setattr(mm, "_matmul", recorder("triton"))

    def route(m, n, dtype=jnp.bfloat16, transpose_w=False, k=256, **kw):
        x = jnp.zeros((m, k), dtype)
        w = jnp.zeros((n, k) if transpose_w else (k, n), dtype)
        out = mm.matmul(x, w, transpose_w=transpose_w, interpret=False, **kw)
        assert out.shape == (m, n)
        return calls.pop()

    monkeypatch.setenv("JAX_OFFLOAD_HOPPER_MATMUL", "0")
    assert route(600, 512) == "triton"  # turned off
    monkeypatch.delenv("JAX_OFFLOAD_HOPPER_MATMUL")
    assert route(600, 512) == "wgmma"
    assert route(64, 16384) == "wgmma"
    assert route(256, 512) == "triton"
    assert route(256, 512, k=4096) == "wgmma"
    assert route(128, 512, k=4096) == "triton"
    assert route(128, 6144, k=4096) == "wgmma"  # k * n >= 24 Mi from 128 rows
    assert route(128, 4096, k=4096) == "triton"
    assert route(64, 4096, k=14336) == "wgmma"  # K's chunks add in two groups (w_down) from 64 rows
    assert route(32, 4096, k=14336) == "triton"
    # Narrow weights at decode sizes take CTAs of 64 rows while they fit one wave of 132 (a CTA for each of a deep
    # K's two groups: w_down); 128-row CTAs otherwise.
    tiles.clear()
    route(128, 4096, k=14336)
    route(256, 4096, k=14336)
    route(256, 4096, k=4096)
    route(256, 6144, k=4096)
    route(8192, 4096, k=14336)
    assert tiles == [dict(tile_m=64, tile_n=64, split_rows=False, one_pass=False),
                     dict(tile_m=64, tile_n=128, split_rows=True, one_pass=False),
                     dict(tile_m=64, tile_n=64, split_rows=False, one_pass=False),
                     dict(tile_m=64, tile_n=128, split_rows=True, one_pass=False),
                     dict(tile_m=64, tile_n=128, split_rows=True, one_pass=False)], tiles
    # Wide weights sum K in one pass for every token: CTAs of 128 x 256 from 65 rows on; at 64 rows 64 x 128 while
    # they make two waves at most (w_gate_up), else 64 x 256 (an LM head).
    tiles.clear()
    for m, n in [(256, 28672), (128, 28672), (64, 28672), (64, 128256)]:
        route(m, n, k=4096)
    assert tiles == [dict(tile_m=128, tile_n=128, split_rows=False, one_pass=True),
                     dict(tile_m=64, tile_n=256, split_rows=True, one_pass=True),
                     dict(tile_m=64, tile_n=64, split_rows=False, one_pass=True),
                     dict(tile_m=64, tile_n=128, split_rows=False, one_pass=True)], tiles
    assert route(600, 512, transpose_w=True) == "triton"
    assert route(600, 512, block_n=128) == "triton"
    assert route(600, 512, dtype=jnp.float32) == "triton"
