"""Per-page log-sum-exp of an int4 key sketch's scores (sketch decode's page choice) in Pallas's Mosaic GPU backend.

The contract of `sketch.sketch_page_lse(..., bits=4)` on an sm_90 GPU: q [Hkv, G, D] bfloat16 (G <= 8, D 128);
codes uint32 [Hkv, page_size, P, D / 8], sign-magnitude int4 codes eight to a word (the layout in
`pallas_kernels/sketch.py`'s docstring); scales float32 [Hkv, page_size, P]. Returns float32
[Hkv, G, num_pages]: per page and query head log sum_{t in page} exp((q . codes_t) * scale_t * sm_scale).

Why a second kernel: the Triton one walks a page's token offsets one load after another and reads the sketch at
~65% of the rate XLA reads the same bytes at; here every tile is in flight before the first is used (H100, 30
layers, 256K tokens in 2.05-2.30 ms over the seven calls that timed it, against Triton's 2.59-2.73 and XLA's read
of the same bytes in 1.54-1.77, all by the wall-time estimate of `bench/results/runs/h100_sketch_relabel/`). Read
from a trace instead, one 256K launch takes 55 us at 80% of the H100's DRAM peak, the engine's 30-layer scoring 1.91
ms (`bench/results/runs/h100_sketch_timeline/`).

How: one CTA (one warpgroup) per (64 pages, KV head); several requests' pages are one launch, each CTA taking its
request's query and reading its tile where it lies (`sketch_page_lse_requests_mgpu`'s `tile_starts`: a shared
store's sketch needs no gather, which took 4.1 ms of an H200's 25.5 ms step of 8 x 64K). Its token offsets' code
tiles ([64 pages, D / 2] bytes, 4 KiB each) come by TMA into a ring of 4 slots. Offset after offset it reads a tile
as int4 through a second view of the same shared memory, eight codes (one word) per 32-bit load (Mosaic GPU's
WGMMA_UPCAST_4X layout), and widens each word where it is: rotated and masked, pair k of the word is two bfloat16
subnormals, code * 2^-133 (`_widen`: 7 instructions per 8 codes), handed to wgmma in its operand's layout without
moving between threads; wgmma multiplies them with the query group (scaled by 2^40, exact, so that the products are
normal float32 numbers; |q| must stay under 2^88) held in shared memory: M = 64 pages, N = the group padded to 8, K
= D, two offsets' products issued before one wait. Once every thread holds a group's codes, their slots take the
offsets 4 ahead. The groups of offsets are a loop, not unrolled: 16 unrolled tiles overflowed the instruction cache
(H200, 30 layers of 256K: 1.88 ms against 2.07 for groups of four unrolled,
`bench/results/runs/h200_sketch_persistent/`). The words and the ring took 3.4-4.6% off at 256K and 6-9% at 128K
against the two's-complement bytes with all 16 tiles in shared memory (H100, three calls; 99 registers a thread
against 117 and ~25 KiB of shared memory a CTA against ~74 KiB, so four CTAs share an SM, held back by registers,
instead of three: `bench/results/runs/h100_sketch_words/`). Rings of 2, 3, 8 or 16 slots, or one offset a wait (62
registers, eight CTAs an SM), time the same or slower (`bench/results/runs/h100_sketch_slots/`). The query's
channels are permuted to the order the codes land in (`_wgmma_channels`), so no code moves. Each token's scale and
the softmax scale go on in float32 and the tiles fold into a running per-page log-sum-exp in base 2. The sketch is
read once, by TMA, and no per-token score reaches memory.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import INT4_PAIR_MASK, LN2, LOG2E, NEG_INF, check_sm_scale, mosaic_load, on_hopper

try:  # Importing runs no GPU code; a jax without Mosaic GPU only makes `is_supported` say False.
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
except ImportError:  # pragma: no cover
    plgpu = None

BLOCK_PAGES = 64  # wgmma's M: one page a row
HEAD_DIM = 128
_GROUP_PAD = 8  # wgmma's smallest N
_OFFSETS_A_WAIT = 2  # token offsets whose products are issued before one wait (see the module docstring)
_TILE_SLOTS = 4  # code tiles a CTA holds in shared memory, a ring over its token offsets
# A widened code is code * 2^-133 (a bfloat16 subnormal); the query goes in scaled by 2^40 (exact for |q| < 2^88) so
# that their products are normal float32 numbers, and the scores' scale takes the powers of two back.
_CODE_LIFT, _Q_LIFT = 2.0 ** 133, 2.0 ** 40
_TILE_BYTES = BLOCK_PAGES * HEAD_DIM // 2
_SMEM_LIMIT = 200 * 1024  # of the 227 KiB a CTA may take: room for the query and output tiles


def is_supported(q: jax.Array, codes: jax.Array) -> bool:
    """True when `sketch_page_lse_mgpu` can run this call here: a Hopper (sm_90) GPU is the default device, q
    bfloat16 [Hkv, G <= 8, 128], int4 words (uint32) of a page size whose scales fit in shared memory, and a page
    count whose float32 scale rows are whole 16-byte units (TMA)."""
    if plgpu is None or q.ndim != 3 or codes.ndim != 4 or q.dtype != jnp.bfloat16:
        return False
    hkv, group, d = q.shape
    page, p = codes.shape[1:3]
    if d != HEAD_DIM or group > _GROUP_PAD or codes.shape != (hkv, page, p, d // 8) or codes.dtype != jnp.uint32:
        return False
    return p % 4 == 0 and _TILE_SLOTS * _TILE_BYTES + page * BLOCK_PAGES * 4 <= _SMEM_LIMIT and on_hopper()


def _wgmma_channels(d: int = HEAD_DIM) -> np.ndarray:
    """The channel each row of the wgmma's B operand (the query) must hold. A tile loaded in WGMMA_UPCAST_4X and
    widened to bfloat16 gives thread c of a quad, per 32 columns, columns 8c .. 8c + 7 of the int4 view; wgmma's
    layout has thread c hold columns 2c, 2c + 1 of each 8. Seen as wgmma's layout without moving anything (pair i of
    the thread's 8 taken as its pair in the i-th 8 columns), position 32t + 8i + 2c + b holds view column
    32t + 8c + 2i + b, and view column 2j holds channel j, 2j + 1 channel j + D / 2 (pair i of word c holds
    low and high code 4c + i: the word format)."""
    k = np.arange(d)
    view = 32 * (k // 32) + 8 * ((k // 2) % 4) + 2 * ((k // 8) % 4) + k % 2
    return view // 2 + (d // 2) * (view % 2)


def _widen(tile):
    """int4 [64, D] in WGMMA_UPCAST_4X (a register: the 8 codes of one 32-bit word) -> bfloat16 [64, D] in wgmma's
    layout, code * 2^-133: pair k of a word (the word rotated right by 4k bits, masked: two bfloat16 subnormals) is
    the thread's pair in the k-th 8 columns, so nothing moves between threads and the columns come out in
    `_wgmma_channels`' order, which the query is given in."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(tile.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def widen(_, x):
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(x.shape), dtype=object)
        for idx, reg in np.ndenumerate(x.registers):
            word = mgpu_utils.bitcast(reg, i32)
            for k in range(4):
                asm = (f"and.b32 $0, $1, {INT4_PAIR_MASK};" if k == 0 else
                       f"{{ .reg .b32 t; shf.r.wrap.b32 t, $1, $1, {4 * k}; and.b32 $0, t, {INT4_PAIR_MASK}; }}")
                pair = llvm.inline_asm(i32, [word], asm, "=r,r")
                regs[(idx[0], idx[1] * 4 + k, *idx[2:])] = mgpu_utils.bitcast(pair, bf16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return widen(tile)


def _kernel(q_ref, codes_ref, scale_ref, starts_ref, out_ref, codes_words, codes_i4, q_smem, scale_smem, out_smem,
            ready, q_ready, scale_ready, *, batch: int, rescale: float, blocks_per_request: int | None):
    block = lax.axis_index("pages")
    head = lax.axis_index("heads")
    request = 0 if blocks_per_request is None else block // blocks_per_request  # None: one request
    pages = pl.ds(starts_ref[block], BLOCK_PAGES)  # where the tile's pages lie in the sketch
    offsets = scale_smem.shape[0]
    slots = codes_words.shape[0]

    def fetch(o, slot):
        plgpu.copy_gmem_to_smem(codes_ref.at[head, o, pages], codes_words.at[slot], ready.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[request, head], q_smem, q_ready)
    plgpu.copy_gmem_to_smem(scale_ref.at[head, :, pages], scale_smem, scale_ready)
    for o in range(slots):  # pages past the sketch's end read as zeros
        fetch(o, o)
    wgmma_layout = plgpu.Layout.WGMMA
    shape = (BLOCK_PAGES, _GROUP_PAD)
    m = plgpu.layout_cast(jnp.full(shape, NEG_INF, jnp.float32), wgmma_layout)
    l = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    plgpu.barrier_wait(q_ready)
    plgpu.barrier_wait(scale_ready)

    def group(g, carry):
        m, l = carry
        offsets_of_group = [g * batch + i for i in range(batch)]
        slots_of_group = [lax.rem(o, slots) for o in offsets_of_group] if slots < offsets else offsets_of_group
        tiles = []
        for slot in slots_of_group:
            plgpu.barrier_wait(ready.at[slot])
            tiles.append(_widen(mosaic_load(codes_i4.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_4X)))
        if slots < offsets:
            plgpu.commit_smem()  # every thread holds these slots' codes: the slots take the offsets a ring ahead
            for o, slot in zip(offsets_of_group, slots_of_group):
                @pl.when(o + slots < offsets)
                def _refill(o=o, slot=slot):
                    fetch(o + slots, slot)

        def scores(*acc_refs):
            for acc_ref, k in zip(acc_refs, tiles):
                plgpu.wgmma(acc_ref, k, q_smem.transpose((1, 0)))
            return [acc_ref[...] for acc_ref in acc_refs]

        s = pl.run_scoped(scores, *[plgpu.ACC(shape, jnp.float32) for _ in range(batch)])
        rows = [mosaic_load(scale_smem.at[o], layout=wgmma_layout.reduce(1)) for o in offsets_of_group]
        s = [x * lax.broadcast_in_dim(r * rescale, shape, [0]) for x, r in zip(s, rows)]
        m_new = functools.reduce(jnp.maximum, s, m)
        return m_new, l * jnp.exp2(m - m_new) + functools.reduce(jnp.add, [jnp.exp2(x - m_new) for x in s])

    m, l = lax.fori_loop(0, offsets // batch, group, (m, l))
    out_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[head, pl.ds(block * BLOCK_PAGES, BLOCK_PAGES)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the write lands before the kernel ends


@functools.partial(jax.jit, static_argnames=("num_pages", "sm_scale"))
def _launch(q, codes, scale, tile_starts, *, num_pages: int, sm_scale: float):
    """q [R, Hkv, G, D] of R requests, each num_pages pages (a whole number of tiles, or one request), tile t of
    them at pages [tile_starts[t], + 64) of the sketch -> [R, Hkv, G, num_pages]. A CTA's tile is one request's, so
    its bits are those of the request alone."""
    requests, hkv, group, d = q.shape
    page = codes.shape[1]
    blocks = -(-num_pages // BLOCK_PAGES)
    half = d // 2
    q_pad = jnp.pad(q[..., _wgmma_channels(d)], ((0, 0), (0, 0), (0, _GROUP_PAD - group), (0, 0))) \
        * jnp.bfloat16(_Q_LIFT)

    def swizzled(shape, dtype, swizzle_bytes):
        elements = swizzle_bytes * 8 // jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else \
            swizzle_bytes // jnp.dtype(dtype).itemsize
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elements)),
                                                    plgpu.SwizzleTransform(swizzle_bytes)))

    # The code tiles as TMA writes them (words) and as the kernel reads them (int4): one buffer, two views.
    slots = min(_TILE_SLOTS, page)
    codes_smem = plgpu.RefUnion(swizzled((slots, BLOCK_PAGES, d // 8), jnp.uint32, half),
                                swizzled((slots, BLOCK_PAGES, d), jnp.int4, half))
    batch = math.gcd(_OFFSETS_A_WAIT, page)
    kernel = functools.partial(_kernel, batch=batch, rescale=sm_scale * LOG2E * _CODE_LIFT / _Q_LIFT,
                               blocks_per_request=blocks if requests > 1 else None)
    out = plgpu.kernel(
        lambda q_ref, c_ref, s_ref, t_ref, o_ref, views, *rest: kernel(q_ref, c_ref, s_ref, t_ref, o_ref, *views,
                                                                       *rest),
        out_type=jax.ShapeDtypeStruct((hkv, requests * blocks * BLOCK_PAGES, _GROUP_PAD), jnp.float32),
        scratch_types=(
            codes_smem,
            swizzled((_GROUP_PAD, d), jnp.bfloat16, 128),
            plgpu.SMEM((page, BLOCK_PAGES), jnp.float32),
            plgpu.SMEM((BLOCK_PAGES, _GROUP_PAD), jnp.float32),
            plgpu.Barrier(num_barriers=slots),  # a slot's code tile is in
            plgpu.Barrier(),  # the query group is in
            plgpu.Barrier(),  # the scales are in
        ),
        grid=(requests * blocks, hkv),
        grid_names=("pages", "heads"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q_pad, codes, scale, tile_starts.astype(jnp.int32))
    out = out.reshape(hkv, requests, blocks * BLOCK_PAGES, _GROUP_PAD)[:, :, :num_pages, :group]
    return jnp.transpose(out, (1, 0, 3, 2))


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
    tiles = jnp.arange(-(-num_pages // BLOCK_PAGES), dtype=jnp.int32) * BLOCK_PAGES
    return _launch(q[None], codes, scale.astype(jnp.float32), tiles, num_pages=num_pages,
                   sm_scale=check_sm_scale(sm_scale, d))[0]


def sketch_page_lse_requests_mgpu(q: jax.Array, codes: jax.Array, scale: jax.Array, *, num_pages: int,
                                  tile_starts: jax.Array | None = None, sm_scale: float | None = None) -> jax.Array:
    """`sketch_page_lse_mgpu` of R requests in one launch: q [R, Hkv, G, D], each request's num_pages pages (a
    multiple of 64: a tile is one request's) in 64-page tiles, tile t of them (request t // (num_pages / 64)) at
    pages [tile_starts[t], + 64) of the sketch (codes [Hkv, page_size, P, D / 8], scales alike; default: the
    requests end to end, P = R * num_pages) -> [R, Hkv, G, num_pages], each request's the bits it gets alone. The
    tiles are read where they lie, so a shared store's sketch needs no gather first. The caller checks
    `is_supported` (with q[0]) first."""
    requests, hkv, _, d = q.shape
    page, p = codes.shape[1:3]
    tiles = requests * num_pages // BLOCK_PAGES
    if tile_starts is None:
        tile_starts = jnp.arange(tiles, dtype=jnp.int32) * BLOCK_PAGES
        if p != requests * num_pages:
            raise ValueError(f"codes {codes.shape} hold {p} pages; allowed: {requests} requests of num_pages="
                             f"{num_pages} end to end, or tile_starts")
    if num_pages % BLOCK_PAGES or scale.shape != (hkv, page, p) or tile_starts.shape != (tiles,):
        raise ValueError(f"codes {codes.shape}, scales {scale.shape} and tile_starts "
                         f"{getattr(tile_starts, 'shape', None)} for {requests} requests of num_pages={num_pages}; "
                         f"allowed: num_pages a multiple of {BLOCK_PAGES}, scales ({hkv}, {page}, {p}), tile_starts "
                         f"({tiles},)")
    return _launch(q, codes, scale.astype(jnp.float32), tile_starts, num_pages=num_pages,
                   sm_scale=check_sm_scale(sm_scale, d))
