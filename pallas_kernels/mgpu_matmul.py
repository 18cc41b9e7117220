"""The batch-invariant matmul's sums (pallas_kernels/matmul.py) on Hopper's warpgroup MMA, in Pallas's Mosaic GPU
backend: for prefill and wide decode batches, where the Triton form runs on warp-level MMA at ~1.3-1.5x cuBLAS's
time (bench/results/runs/h200_invariant_price/).

The same float32 sums in the same order: each `K_CHUNK` keys' 64-key tile products accumulated from zero in
ascending order (`wgmma` adds a tile's products into its accumulator as Triton's dot does: JAX's own Hopper matmul
gave the Triton form's bits over one chunk, bench/results/runs/h200_invariant_price/hopper_matmul/), the chunks'
sums added to a running total in ascending order, rounded once. The total starts at -0.0, so the first chunk's
sum enters it unchanged (-0.0 + s == s for every s, -0.0 and +0.0 included), as the Triton form's total starts as
that sum.

A CTA computes two warpgroup tiles of (tile_m, tile_n) side by side (`split_rows`: one above the other): a producer
warpgroup streams x's and w's 64-key tiles through a ring of shared-memory slots (TMA), two consumer warpgroups each
multiply into their own tile. In chunks, a consumer holds two float32 tiles in registers (the chunk's sum and the
total), so tile_m * tile_n / 64 registers a thread: 128 for 64 x 128 or 128 x 64 tiles, 256 for 128 x 128, past the
~232 a consumer gets beside a 40-register producer (the Triton form's 128 x 256 prefill tiles ran into the same,
runs/h200_invariant_price/). In one pass (`one_pass`, a prompt's tokens) it holds one, and prefill takes 128 x 128
tiles: JAX's own one-pass Hopper matmul ran the 8B's projections at 8,192 rows at 1.02-1.04x cuBLAS with them, with
the Triton one-pass form's bits (runs/h200_invariant_price/price_2026_11_30/gemv_one_pass/); this form with them
brought the 8B's 32K prefill in the mode to 1.015x the default's (price_2026_11_30/prefill_one_pass/). Output tiles
are walked in groups of GROUP_M row tiles so that the CTAs in flight share their x rows and w columns in L2.

`matmul.matmul` routes to it on Hopper (`matmul.wgmma_suits` says where; JAX_OFFLOAD_HOPPER_MATMUL=0 turns it off).
On an H200 it gave the Triton form's bits at every shape and tile config probed and runs 1.17x cuBLAS's time over an
8B layer's projections at 8,192 rows, where the Triton form takes 1.48x (bench/results/runs/h200_invariant_price/
hopper_matmul/wgmma/).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import mosaic_interpret_params
from pallas_kernels.matmul import BLOCK_K, ONE_PASS_N, chunk_len_for, k_groups_for, sums_in_one_pass

try:  # Importing runs no GPU code; a jax without Mosaic GPU only makes `mgpu_matmul` unavailable.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

_COMPUTE_WGS = 2
_PRODUCER_REGS = 40
_EPILOGUE = 64  # an output store's rows and columns: two such slots per warpgroup beside the ring
_SMEM_BYTES = 227 * 1024 - 1024  # a CTA's shared memory on Hopper, less room for the pipeline's barriers
GROUP_M = 8
# CTAs one wave holds: Hopper's 132 SMs (H100 SXM, H200), one CTA each (a CTA takes most of an SM's shared memory).
_WAVE = 132


def default_tiles(m: int, n: int, one_pass: bool = False, groups: int = 1) -> dict:
    """A CTA's tiles for `m` rows against N = `n` columns, K's sum in `groups` groups (`matmul.k_groups_for`: a CTA a
    group). In chunks (a consumer holds two float32 tiles): 128 x 128 CTAs (two 64 x 128 tiles, one above the other),
    unless CTAs of 64 rows x 128 columns (two 64 x 64 tiles side by side) still fit one wave: a decode batch against a
    narrow weight, where 128-row CTAs leave SMs idle (the 8B's w_down at 256 rows: 67.1 us against 83.1, its wo 23.6
    against 29.6; runs/h200_invariant_price/price_2026_11_30/matmul/). In one pass (one float32 tile) past 512 rows
    (prefill), two 128 x 128 tiles a CTA (JAX's one-pass Hopper matmul with them: 1.02-1.04x cuBLAS over the 8B's
    projections at 8,192 rows, price_2026_11_30/gemv_one_pass/). In one pass against a wide weight (matmul.ONE_PASS_N
    columns: every token of w_gate_up and LM heads), CTAs of 128 x 256 from 65 rows on, at 64 rows of 64 x 128 while
    they make at most two waves, else 64 x 256: the best of six CTA shapes at 64, 128 and 256 rows of the 8B's w_gate_up
    and LM head but one (2% off), 0.98-1.03x cuBLAS, where the chunks took 1.04-1.21x
    (runs/h200_invariant_price/price_2026_12_01/wide_one_pass/). They change the speed, not the bits."""
    if one_pass and (m > 512 or n >= ONE_PASS_N):
        cta_256 = n % (_COMPUTE_WGS * 128) == 0  # N takes CTAs of 256 columns
        if m <= 64:
            return dict(tile_m=64, tile_n=128 if cta_256 and n // 128 > 2 * _WAVE else 64, split_rows=False)
        if m <= 128 and cta_256:
            return dict(tile_m=64, tile_n=256, split_rows=True)
        return dict(tile_m=128, tile_n=128, split_rows=not cta_256)
    if -(-m // 64) * (n // 128) * groups <= _WAVE:
        return dict(tile_m=64, tile_n=64, split_rows=False)
    return dict(tile_m=64, tile_n=128, split_rows=True)


def ring_slots(tile_m: int, tile_n: int, split_rows: bool, dtype, store_dtype) -> int | None:
    """Shared-memory ring slots a CTA of these tiles takes by default: 6 where they fit beside the output's slots (in
    `store_dtype`), else the most of 4, 3 or 2 that do; None where not even 2 fit. The output's slots take 32 KiB in
    bf16, 64 KiB in float32 (the products tensor parallelism adds across devices, a deep K's group sums), where 6
    slots did not fit (262,240 bytes on an H200)."""
    cta_m, cta_n = (_COMPUTE_WGS * tile_m, tile_n) if split_rows else (tile_m, _COMPUTE_WGS * tile_n)
    slot_bytes = (cta_m + cta_n) * BLOCK_K * jnp.dtype(dtype).itemsize
    out_bytes = _COMPUTE_WGS * 2 * _EPILOGUE * _EPILOGUE * jnp.dtype(store_dtype).itemsize
    return next((s for s in (6, 4, 3, 2) if s * slot_bytes + out_bytes <= _SMEM_BYTES), None)


def _swizzled(elems_per_row: int):
    # (8, 128 B) tiles with a 128-byte swizzle: what TMA writes and wgmma reads without bank conflicts.
    return (plgpu.TilingTransform((8, elems_per_row)), plgpu.SwizzleTransform(128))


def store_tile(out: jax.Array, slots, dst) -> None:
    """A consumer warpgroup's output tile (in registers) to `dst` in global memory, in _EPILOGUE x _EPILOGUE pieces
    through its two shared-memory slots `slots` [2, _EPILOGUE, _EPILOGUE] (TMA stores, one slot filling while the
    other's store leaves)."""
    pieces = [(i, j) for i in range(out.shape[0] // _EPILOGUE) for j in range(out.shape[1] // _EPILOGUE)]
    for p, (i, j) in enumerate(pieces):
        slot = p % 2
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's previous store has left
        slots[slot] = out[i * _EPILOGUE:(i + 1) * _EPILOGUE, j * _EPILOGUE:(j + 1) * _EPILOGUE]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(slots.at[slot],
                                dst.at[pl.ds(i * _EPILOGUE, _EPILOGUE), pl.ds(j * _EPILOGUE, _EPILOGUE)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(x_gmem, w_gmem, o_gmem, o_smem, *, tile_m: int, tile_n: int, split_rows: bool, steps: int,
            m_tiles: int, n_tiles: int, k_groups: int, cluster: str | None, one_pass: bool, interpret: bool):
    k = x_gmem.shape[1]
    tiles_per_chunk = chunk_len_for(k, one_pass) // BLOCK_K
    # Grouped order over the clusters' tiles (a cluster of two CTAs covers two row tiles, or two column tiles, of
    # the output): GROUP_M row tiles across every column tile, then the next group. With K in groups
    # (`matmul.k_groups_for`), the CTAs of K's first group, then its second's: each CTA sums its group's keys into
    # float32 rows of its own (o_gmem holds k_groups outputs one above the other), added in order after.
    m_mult, n_mult = (2, 1) if cluster == "m" else (1, 2) if cluster == "n" else (1, 1)
    cluster_m_tiles, cluster_n_tiles = m_tiles // m_mult, n_tiles // n_mult
    tile = lax.axis_index("tile")
    k_group, tile = tile // (cluster_m_tiles * cluster_n_tiles), tile % (cluster_m_tiles * cluster_n_tiles)
    k_span = k // k_groups
    keys = pl.ds(k_group * k_span, k_span)
    group = tile // (GROUP_M * cluster_n_tiles)
    first_m = group * GROUP_M
    group_rows = jnp.minimum(cluster_m_tiles - first_m, GROUP_M)
    in_group = tile % (GROUP_M * cluster_n_tiles)
    m_idx = first_m + in_group % group_rows
    n_idx = in_group // group_rows
    if cluster is not None:
        cta = lax.axis_index("cluster")
        m_idx, n_idx = m_idx * m_mult + cta * (m_mult - 1), n_idx * n_mult + cta * (n_mult - 1)
    cta_m, cta_n = (_COMPUTE_WGS * tile_m, tile_n) if split_rows else (tile_m, _COMPUTE_WGS * tile_n)
    cta_rows, cta_cols = pl.ds(m_idx * cta_m, cta_m), pl.ds(n_idx * cta_n, cta_n)
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(wg * tile_m, tile_m) if split_rows else slice(None)
    wg_cols = slice(None) if split_rows else pl.ds(wg * tile_n, tile_n)

    def filled(value: float):
        v = jnp.full((tile_m, tile_n), value, jnp.float32)
        return v if interpret else plgpu.layout_cast(v, plgpu.Layout.WGMMA)

    def add_tile(part, x_smem, w_smem):
        if interpret:  # the CPU interpreter takes no register accumulator: a tile's dot added, as Triton's form
            return part + lax.dot(x_smem.at[wg_rows][...], w_smem.at[:, wg_cols][...],
                                  preferred_element_type=jnp.float32)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.at[:, wg_cols])

        return pl.run_state(mma)(plgpu.ACC.init(part))

    def step(idxs, x_smem, w_smem, carry):
        (t,) = idxs
        if one_pass:
            return add_tile(carry, x_smem, w_smem)
        part, total = carry
        part = add_tile(part, x_smem, w_smem)
        # A chunk's last tile: its sum joins the total, the next chunk starts from zero.
        return lax.cond((t + 1) % tiles_per_chunk == 0, lambda p, s: (filled(0.0), s + p), lambda p, s: (p, s),
                        part, total)

    def compute(run_pipeline):
        if one_pass:
            total = run_pipeline(filled(0.0))
        else:
            _, total = run_pipeline((filled(0.0), filled(-0.0)))
        out_rows = pl.ds(k_group * m_tiles * cta_m + m_idx * cta_m, cta_m)
        store_tile(total.astype(o_gmem.dtype), o_smem.at[wg], o_gmem.at[out_rows, cta_cols].at[wg_rows, wg_cols])

    pipeline = plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(k_span // BLOCK_K,),
        memory_registers=_PRODUCER_REGS,
        # A cluster's two CTAs share one operand's tiles: TMA multicasts them to both.
        in_specs=[plgpu.BlockSpec((cta_m, BLOCK_K), lambda t: (0, t), transforms=_swizzled(BLOCK_K),
                                  collective_axes=("cluster",) if cluster == "n" else ()),
                  plgpu.BlockSpec((BLOCK_K, cta_n), lambda t: (t, 0), transforms=_swizzled(BLOCK_K),
                                  collective_axes=("cluster",) if cluster == "m" else ())],
        wg_axis="wg",
        num_compute_wgs=_COMPUTE_WGS,
        max_concurrent_steps=steps,
        compute_context=compute,
    )
    pipeline(x_gmem.at[cta_rows, keys], w_gmem.at[keys, cta_cols])


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_m", "tile_n", "split_rows", "steps", "cluster",
                                             "one_pass", "interpret"))
def _mgpu_matmul(x, w, *, out_dtype, tile_m, tile_n, split_rows, steps, cluster, one_pass, interpret):
    m, k = x.shape
    n = w.shape[1]
    cta_m, cta_n = (_COMPUTE_WGS * tile_m, tile_n) if split_rows else (tile_m, _COMPUTE_WGS * tile_n)
    rows_per_cluster = cta_m * (2 if cluster == "m" else 1)
    m_pad = -(-m // rows_per_cluster) * rows_per_cluster
    if m_pad != m:  # rows do not mix: zero rows change no other row's bits
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    m_tiles, n_tiles = m_pad // cta_m, n // cta_n
    k_groups = k_groups_for(k, one_pass)
    store_dtype = jnp.dtype(jnp.float32) if k_groups > 1 else out_dtype  # a group's sum, added to the others' after
    kernel = functools.partial(_kernel, tile_m=tile_m, tile_n=tile_n, split_rows=split_rows, steps=steps,
                               m_tiles=m_tiles, n_tiles=n_tiles, k_groups=k_groups, cluster=cluster,
                               one_pass=one_pass, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((k_groups * m_pad, n), store_dtype),
        scratch_types=(plgpu.SMEM((_COMPUTE_WGS, 2, _EPILOGUE, _EPILOGUE), store_dtype,
                                  transforms=_swizzled(128 // store_dtype.itemsize)),),
        grid=(k_groups * m_tiles * n_tiles // (1 if cluster is None else 2),),
        grid_names=("tile",),
        cluster=() if cluster is None else (2,),
        cluster_names=() if cluster is None else ("cluster",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        interpret=mosaic_interpret_params() if interpret else None,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, w)
    if k_groups > 1:
        out = functools.reduce(operator.add, list(out.reshape(k_groups, m_pad, n)[:, :m])).astype(out_dtype)
    return out[:m]


def mgpu_matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, tile_m: int = 64, tile_n: int = 128,
                split_rows: bool = True, steps: int | None = None, cluster: str | None = None, one_pass: bool = False,
                interpret: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in `out_dtype` (default x's), the bits of `matmul.matmul(x, w, one_pass=...)`.

    Args:
      x, w: bfloat16 or float16 (wgmma operands), one dtype; K a multiple of 64, N of the CTA's columns.
      tile_m, tile_n: the output tile of each of a CTA's two consumer warpgroups (tile_m 64 or 128, tile_n 64,
        128 or 256); split_rows: the two tiles one above the other (a CTA of 2 * tile_m rows and tile_n columns),
        else side by side; steps: shared-memory ring slots (each a CTA's rows x 64 of x and 64 x its columns of w),
        by default 6 where they fit beside the output's slots, else the most of 4, 3 or 2 that do (6 ran 5% faster
        at 256 rows on an H200, the same at 8,192); cluster: "m" runs CTAs in pairs over two row tiles, each weight
        tile loaded once for both (multicast), "n" pairs over two column tiles sharing x's tiles, None single CTAs.
        They change the speed, not the bits.
      one_pass: all of K summed as one chunk (matmul.matmul's `one_pass`; weights of matmul.ONE_PASS_N columns or
        more always), one float32 tile a consumer instead of two.
      interpret: run Mosaic GPU's CPU interpreter instead (tests only; small shapes).
    """
    if plgpu is None:
        raise RuntimeError("mgpu_matmul needs jax's Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x has shape {x.shape} and w {w.shape}; allowed: x [M, K] and w [K, N]")
    if x.dtype != w.dtype or (x.dtype not in (jnp.bfloat16, jnp.float16) and not interpret):
        raise ValueError(f"x has dtype {x.dtype} and w {w.dtype}; allowed: one dtype, bfloat16 or float16")
    if tile_m not in (64, 128) or tile_n not in (64, 128, 256):
        raise ValueError(f"tile_m={tile_m}, tile_n={tile_n}; allowed: tile_m 64 or 128, tile_n 64, 128 or 256")
    if cluster not in (None, "m", "n"):
        raise ValueError(f"cluster={cluster!r}; allowed: None, 'm' or 'n'")
    k, n = w.shape
    cta_n = tile_n if split_rows else _COMPUTE_WGS * tile_n
    cols = cta_n * (2 if cluster == "n" else 1)
    if k % BLOCK_K or n % cols:
        raise ValueError(f"w has shape {w.shape}; allowed: K a multiple of {BLOCK_K}, N of {cols}")
    one_pass = sums_in_one_pass(n, one_pass)
    if steps is None:
        store_dtype = jnp.float32 if k_groups_for(k, one_pass) > 1 else out_dtype or x.dtype
        steps = ring_slots(tile_m, tile_n, split_rows, x.dtype, store_dtype)
        if steps is None:
            raise ValueError(f"tiles {tile_m} x {tile_n} (split_rows={split_rows}) of {x.dtype}: not even 2 ring slots "
                             f"fit beside the output's in {_SMEM_BYTES} bytes of shared memory; allowed: smaller tiles")
    return _mgpu_matmul(x, w, out_dtype=jnp.dtype(out_dtype or x.dtype), tile_m=tile_m, tile_n=tile_n,
                        split_rows=split_rows, steps=steps, cluster=cluster, one_pass=one_pass,
                        interpret=interpret)
