"""Per-page log-sum-exp of an int4 key sketch's scores (sketch decode's page choice) in Pallas's Mosaic GPU backend.

The contract of `sketch.sketch_page_lse(..., bits=4)` on an sm_90 GPU: q [Hkv, G, D] bfloat16 (G <= 8, D 128);
codes uint8 [Hkv, page_size, P, D / 2], byte i of a token holding channel i in its low nibble and channel i + D / 2
in its high one, each a 4-bit two's complement integer; scales float32 [Hkv, page_size, P]. Returns float32
[Hkv, G, num_pages]: per page and query head log sum_{t in page} exp((q . codes_t) * scale_t * sm_scale).

Why a second kernel: the Triton one walks a page's token offsets one load after another and reads the sketch at
~65% of the rate XLA reads the same bytes at; here every tile is in flight before the first is used (H100, 30
layers, GPU time: 256K tokens in 2.05-2.30 ms over the seven calls that timed it, against Triton's 2.59-2.73 and
XLA's read of the same bytes in 1.54-1.77; `bench/results/runs/h100_sketch_relabel/`).

How: one CTA (one warpgroup) per (64 pages, KV head). It issues the TMA copies of all its token offsets' code
tiles ([64 pages, D / 2] bytes each, 64 KiB for pages of 16) at once. Offset after offset it reads a tile as int4
through a second view of the same shared memory, eight codes per 32-bit load (Mosaic GPU's WGMMA_UPCAST_4X
layout), widens them to bfloat16 (prmt/lop3) where they are and hands the registers to wgmma as its operand's
layout without moving them between threads (`_as_wgmma_operand`); wgmma multiplies them with the query group held
in shared memory: M = 64 pages, N = the group padded to 8, K = D, four offsets' products issued before one wait.
The query's channels are permuted to the order the codes land in (`_wgmma_channels`), so no code moves. Each
token's scale and the softmax scale go on in float32 and the tiles fold into a running per-page log-sum-exp in
base 2. The sketch is read once, by TMA, and no per-token score reaches memory.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2, LOG2E, NEG_INF, check_sm_scale, mosaic_load, on_hopper

try:  # Importing runs no GPU code; a jax without Mosaic GPU only makes `is_supported` say False.
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

BLOCK_PAGES = 64  # wgmma's M: one page a row
HEAD_DIM = 128
_GROUP_PAD = 8  # wgmma's smallest N
LEVELS = 3  # int8 parts of the query
_TILE_BYTES = BLOCK_PAGES * HEAD_DIM // 2
_SMEM_LIMIT = 200 * 1024  # of the 227 KiB a CTA may take: room for the query, scales and output tiles


def is_supported(q: jax.Array, codes: jax.Array) -> bool:
    """True when `sketch_page_lse_mgpu` can run this call here: a Hopper (sm_90) GPU is the default device, q
    bfloat16 [Hkv, G <= 8, 128], int4 codes of a page size whose tiles fit in shared memory, and a page count whose
    float32 scale rows are whole 16-byte units (TMA)."""
    if plgpu is None or q.ndim != 3 or codes.ndim != 4 or q.dtype != jnp.bfloat16:
        return False
    hkv, group, d = q.shape
    page, p = codes.shape[1:3]
    if d != HEAD_DIM or group > _GROUP_PAD or codes.shape != (hkv, page, p, d // 2) or codes.dtype != jnp.uint8:
        return False
    return p % 4 == 0 and page * _TILE_BYTES <= _SMEM_LIMIT and on_hopper()


def _split_query(q: jax.Array, sm_scale: float) -> tuple[jax.Array, jax.Array]:
    """bfloat16 q [Hkv, G, D] -> int8 parts [Hkv, LEVELS, 8, D] (the group padded to wgmma's N with zeros) and the
    float32 factor per query head [Hkv, 32] that turns sum_i parts_i * 128^(LEVELS - 1 - i) into q, times sm_scale,
    log2(e) and the 1/16 the codes carry (they enter the wgmma as 16 * code). Each part is at most 64 in magnitude and
    the first one's step a power of two: every element of at least 2^-12 of its head's largest is split exactly, the others
    to within 2^-20 of it."""
    qf = q.astype(jnp.float32)
    _, exponent = jnp.frexp(jnp.max(jnp.abs(qf), axis=-1, keepdims=True))  # |q| < 2^exponent
    step = jnp.ldexp(jnp.float32(1), exponent - 6)
    parts, rest = [], qf
    for _ in range(LEVELS):
        part = jnp.round(rest / step)
        parts.append(part.astype(jnp.int8))
        rest, step = rest - part * step, step / 128
    pad = ((0, 0), (0, _GROUP_PAD - q.shape[1]), (0, 0))
    parts = jnp.stack([jnp.pad(x, pad) for x in parts], axis=1)
    # Padded to 32 factors a head: a TMA copy moves a multiple of 128 bytes.
    factor = jnp.pad(step[..., 0] * (128 * sm_scale * LOG2E / 16), ((0, 0), (0, 32 - q.shape[1])))
    return parts, factor


def _widen(tile):
    """uint8 [64, D / 2] in WGMMA_8BIT -> int8 [64, D] in WGMMA_8BIT, 16 * code, column i channel i: a register of 4
    bytes gives its low nibbles shifted up (channels 4j .. 4j + 3 of its 16-column tile) and its high nibbles masked
    (the same channels + D / 2, 4 tiles on); the sign bit of each code lands on its byte's."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                       return_type=plgpu.ShapeDtypeStruct((tile.shape[0], 2 * tile.shape[1]), jnp.int8,
                                                          layout=plgpu.Layout.WGMMA_8BIT))
    def widen(_, x):
        i32 = ir.IntegerType.get_signless(32)
        high_nibbles = mgpu_utils.c(-0x0F0F0F10, i32)  # 0xF0F0F0F0
        tiles = x.registers.shape[1]
        regs = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape((tile.shape[0], 2 * tile.shape[1])), dtype=object)
        for idx, reg in np.ndenumerate(x.registers):
            word = mgpu_utils.bitcast(reg, i32)
            low = arith.andi(arith.shli(word, mgpu_utils.c(4, i32)), high_nibbles)
            regs[idx] = mgpu_utils.bitcast(low, reg.type)
            regs[(idx[0], idx[1] + tiles, *idx[2:])] = mgpu_utils.bitcast(arith.andi(word, high_nibbles), reg.type)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=True)

    return widen(tile)


def _kernel(q_ref, factor_ref, codes_ref, scale_ref, out_ref, codes_smem, q_smem, factor_smem, scale_smem, out_smem,
            ready, q_ready, scale_ready, *, batch: int):
    block = lax.axis_index("pages")
    head = lax.axis_index("heads")
    pages = pl.ds(block * BLOCK_PAGES, BLOCK_PAGES)
    offsets = codes_smem.shape[0]
    plgpu.copy_gmem_to_smem(q_ref.at[head], q_smem, q_ready)
    plgpu.copy_gmem_to_smem(factor_ref.at[head], factor_smem, q_ready)
    plgpu.copy_gmem_to_smem(scale_ref.at[head, :, pages], scale_smem, scale_ready)
    for o in range(offsets):  # every tile in flight at once (pages past the sketch's end read as zeros)
        plgpu.copy_gmem_to_smem(codes_ref.at[head, o, pages], codes_smem.at[o], ready.at[o])
    wgmma_layout = plgpu.Layout.WGMMA
    shape = (BLOCK_PAGES, _GROUP_PAD)
    m = plgpu.layout_cast(jnp.full(shape, NEG_INF, jnp.float32), wgmma_layout)
    l = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    plgpu.barrier_wait(q_ready)
    plgpu.barrier_wait(scale_ready)
    factor = lax.broadcast_in_dim(mosaic_load(factor_smem.at[:_GROUP_PAD], layout=wgmma_layout.reduce(0)), shape, [1])
    for first in range(0, offsets, batch):
        group = range(first, first + batch)
        tiles = []
        for o in group:
            plgpu.barrier_wait(ready.at[o])
            tiles.append(_widen(mosaic_load(codes_smem.at[o], layout=plgpu.Layout.WGMMA_8BIT)))

        def scores(*acc_refs, tiles=tiles):
            for i, k in enumerate(tiles):
                for level in range(LEVELS):
                    plgpu.wgmma(acc_refs[LEVELS * i + level], k, q_smem.at[level].transpose((1, 0)))
            return [acc_ref[...] for acc_ref in acc_refs]

        acc = pl.run_scoped(scores, *[plgpu.ACC(shape, jnp.int32) for _ in range(LEVELS * batch)])
        s = []
        for i, o in enumerate(group):
            parts = acc[LEVELS * i:LEVELS * (i + 1)]
            total = functools.reduce(lambda t, x: t * 128.0 + x.astype(jnp.float32), parts[1:],
                                     parts[0].astype(jnp.float32))
            row = mosaic_load(scale_smem.at[o], layout=wgmma_layout.reduce(1))
            s.append(total * factor * lax.broadcast_in_dim(row, shape, [0]))
        m_new = functools.reduce(jnp.maximum, s, m)
        l = l * jnp.exp2(m - m_new) + functools.reduce(jnp.add, [jnp.exp2(x - m_new) for x in s])
        m = m_new
    out_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[head, pages])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the write lands before the kernel ends


@functools.partial(jax.jit, static_argnames=("num_pages", "sm_scale", "batch"))
def _launch(q, codes, scale, *, num_pages: int, sm_scale: float, batch: int = 4):
    hkv, group, d = q.shape
    page = codes.shape[1]
    blocks = -(-num_pages // BLOCK_PAGES)
    parts, factor = _split_query(q, sm_scale)

    def swizzled(shape, dtype, swizzle_bytes):
        elements = swizzle_bytes // jnp.dtype(dtype).itemsize
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elements)),
                                                    plgpu.SwizzleTransform(swizzle_bytes)))

    out = plgpu.kernel(
        functools.partial(_kernel, batch=math.gcd(batch, page)),
        out_type=jax.ShapeDtypeStruct((hkv, blocks * BLOCK_PAGES, _GROUP_PAD), jnp.float32),
        scratch_types=(
            swizzled((page, BLOCK_PAGES, d // 2), jnp.uint8, d // 2),
            swizzled((LEVELS, _GROUP_PAD, d), jnp.int8, d),
            plgpu.SMEM((32,), jnp.float32),
            plgpu.SMEM((page, BLOCK_PAGES), jnp.float32),
            plgpu.SMEM((BLOCK_PAGES, _GROUP_PAD), jnp.float32),
            plgpu.Barrier(num_barriers=page),  # a code tile is in
            plgpu.Barrier(num_arrivals=2),  # the query's parts and factors are in
            plgpu.Barrier(),  # the scales are in
        ),
        grid=(blocks, hkv),
        grid_names=("pages", "heads"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(parts, factor, codes, scale)
    return jnp.moveaxis(out[:, :num_pages, :group], 2, 1)


def sketch_page_lse_mgpu(q: jax.Array, codes: jax.Array, scale: jax.Array, *, num_pages: int | None = None,
                         sm_scale: float | None = None) -> jax.Array:
    """`sketch.sketch_page_lse(q, codes, scale, bits=4, ...)` on Hopper (see the module docstring); the caller
    checks `is_supported` first."""
    hkv, _, d = q.shape
    page, p = codes.shape[1:3]
    if scale.shape != (hkv, page, p):
        raise ValueError(f"scale has shape {scale.shape}; allowed: ({hkv}, {page}, {p})")
    num_pages = p if num_pages is None else int(num_pages)
    if not 1 <= num_pages <= p:
        raise ValueError(f"num_pages={num_pages}; allowed: 1 to the sketch's {p} pages")
    return _launch(q, codes, scale.astype(jnp.float32), num_pages=num_pages, sm_scale=check_sm_scale(sm_scale, d))
