"""Per-page log-sum-exp of a low-bit key sketch's scores against a query group (sketch decode's page choice).

`sketch_page_lse` launches one program per (block of pages, KV head, share of the token offsets: `default_launch`).
For each of its offsets it loads that token's codes in every page of its block (int4, two per byte, or int8),
unpacks them in registers into exact small integers (int4 with a 16-bit q: float16 values made by bit operations, no
conversion instructions), multiplies them with the KV head's query group on the tensor cores, scales each token by
its float32 scale and folds the scores into a running per-page log-sum-exp, in base 2 (exp2 is one GPU
instruction); the shares' log-sum-exps are combined after: float32 [Hkv, G, P] of
log sum_{t in page} exp((q . codes_t) * scale_t * sm_scale). The sketch is read once and no per-token score reaches
memory. On a Hopper GPU an int4 sketch stored as words (below) goes to `mgpu_sketch`'s kernel instead (TMA copies
in flight, wgmma): the same values to float32 rounding, ~20% less GPU time at 128K-256K tokens on an H100
(`bench/results/runs/h100_sketch_words/`).

Where the time goes (H200, 30 layers of 128K tokens,
`bench/results/runs/h200_sketch_decode/probe_sketch_variants.h200.json`, before the float16 unpacking and the
base-2 softmax took the kernel from 2.56 to 2.26 ms): the loads alone take 1.10 ms, the unpacking and dots 1.0 ms
more, the softmax 0.5 ms; the sketch's HBM time is 0.45 ms. Unpacking in PTX and 4 warps
a program then took it to 1.91 ms at 128K and 3.19 ms at 256K (from 2.14 / 3.94 in the same run); stacking 4 token
offsets in one 16-row score tile (no exp spent on the padding rows of a group of 4) was slower
(`bench/results/runs/h200_sketch_decode/probe_sketch_stacked.json`).

Layout (`jax_offload.sparse.sketch`): codes [Hkv, page_size, P, width], scales [Hkv, page_size, P]: token j of
page p at [:, j, p], so one token offset of a block of pages is one contiguous tile. int4 comes in two layouts, told
apart by the codes' dtype, each the one its kernel widens fastest:
- bytes (uint8, width D / 2; this kernel): byte i of a token holds channel i in its low nibble and channel i + D / 2
  in its high nibble, each in 4-bit two's complement, so the two halves of q meet the two nibbles. Every byte
  decodes alone, as Triton's elementwise asm needs (it hands an asm whichever 4 elements a thread holds).
- words (uint32, width D / 8; the Hopper kernel): sign-magnitude codes (3-bit magnitude and a sign, in [-7, 7]),
  word w of a token holding channels 4w + k ("low", k = 0..3) and D / 2 + 4w + k ("high"). The word rotated right by
  4k bits and masked with INT4_PAIR_MASK leaves low code k's magnitude in bits 0-2 and its sign in bit 15, the high
  code's in bits 16-18 and 31: the bits of two bfloat16 subnormals equal to the codes times 2^-133, so a pair widens
  in two instructions. Unrotated, low code k's magnitude sits at bit 4k and its sign at bit (15 + 4k) mod 32, the
  high code's at 16 + 4k and (31 + 4k) mod 32. (Read by this kernel, the codes of a word would need joins into the
  tensor-core operand: 20-26% slower than the bytes on an H100, `bench/results/runs/h100_sketch_words/`.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mgpu_sketch
from pallas_kernels._common import (
    LN2,
    LOG2E,
    MIN_BLOCK,
    NEG_INF,
    check_sm_scale,
    compiler_params,
    dot_precision,
    fit_block,
    hopper_kernels_allowed,
    interpret_aware_jit,
    next_pow2,
    on_hopper,
    resolve_interpret,
)

SKETCH_BITS = (4, 8)


def _nibbles_as_f16(codes):
    """int4 codes -> their exact float16 values without a conversion instruction: a two's complement nibble v
    flipped in its sign bit is u = v + 8, which becomes the bits of 1024 + u (float16's spacing is 1 there), less
    1024 + 8."""
    u = codes.astype(jnp.uint16) ^ 0x88
    return (lax.bitcast_convert_type((u & 15) | 0x6400, jnp.float16) - 1032.0,
            lax.bitcast_convert_type((u >> 4) | 0x6400, jnp.float16) - 1032.0)


# The same in PTX, four bytes at a time (what the GPU runs): one xor flips the eight nibbles' sign bits, the bytes are
# spread in pairs to the two halves of a word (prmt), one lop3 makes both halves' nibbles into the float16 bits of
# 1024 + u, and one packed subtraction takes 1032 off both. The compiler's version of `_nibbles_as_f16` handles one
# byte per register and packs the pairs afterwards: 11% slower at 128K, 19% at 256K
# (`bench/results/runs/h200_sketch_decode/probe_sketch_stacked.json`). One asm per nibble: Pallas lowers an inline
# asm to one result.
_NIBBLES_AS_F16_PTX = """{
.reg .b32 zero, mask, magic, bias, flipped, b01, b23;
mov.b32 zero, 0;
mov.b32 mask, 0x000F000F;
mov.b32 magic, 0x64006400;
mov.b32 bias, 0x64086408;
xor.b32 flipped, $2, 0x88888888;
prmt.b32 b01, flipped, zero, 0x4140;
prmt.b32 b23, flipped, zero, 0x4342;
%s
lop3.b32 $0, b01, mask, magic, 0xEA;
lop3.b32 $1, b23, mask, magic, 0xEA;
sub.f16x2 $0, $0, bias;
sub.f16x2 $1, $1, bias;
}"""
_LOW_NIBBLES_PTX = _NIBBLES_AS_F16_PTX % ""
_HIGH_NIBBLES_PTX = _NIBBLES_AS_F16_PTX % "shr.b32 b01, b01, 4;\nshr.b32 b23, b23, 4;"


def _nibbles_as_f16_ptx(codes):
    out = [jax.ShapeDtypeStruct(codes.shape, jnp.float16)]
    return tuple(plgpu.elementwise_inline_asm(asm, args=[codes], constraints="=r,=r,r", pack=4,
                                              result_shape_dtypes=out)[0]
                 for asm in (_LOW_NIBBLES_PTX, _HIGH_NIBBLES_PTX))


def _codes_as(codes, bits: int, dtype):
    if bits == 4:
        packed = codes.astype(jnp.int32) ^ 0x88
        return ((packed & 15) - 8).astype(dtype), ((packed >> 4) - 8).astype(dtype)
    return codes.astype(dtype), None


def _page_lse_kernel(q_ref, codes_ref, scale_ref, o_ref, *, block_p: int, group: int, num_pages: int, bits: int,
                     sm_scale: float, precision, ptx: bool):
    start = pl.multiple_of(pl.program_id(0) * block_p, block_p)
    pages = pl.ds(start, block_p)
    # Masks only where the last block is ragged: unmasked loads vectorize best.
    ok = start + jnp.arange(block_p, dtype=jnp.int32) < num_pages if num_pages % block_p else None
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    if bits == 4:  # the low nibbles hold channels 0 .. D/2 - 1, the high ones the rest
        half = codes_ref.shape[-1]
        qs = [plgpu.load(q_ref.at[:, pl.ds(i * half, half)], mask=row_ok[:, None], other=0) for i in (0, 1)]
    else:
        qs = [plgpu.load(q_ref, mask=row_ok[:, None], other=0)]
    dtype, rescale = qs[0].dtype, sm_scale * LOG2E  # base-2 logits: exp2 is the GPU's own instruction
    bit_unpack = bits == 4 and jnp.dtype(dtype).itemsize == 2
    if bit_unpack:
        # float16 operands: the nibbles' values come from bit operations (int4's unpacking is most of the kernel's
        # arithmetic). q is scaled by a power of two (exact) so that its largest element stays in float16's range,
        # and the scores are scaled back.
        top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in qs])
        shift = jnp.maximum(jnp.ceil(jnp.log2(jnp.maximum(top, 1e-30))) - 14.0, 0.0)
        qs = [(x.astype(jnp.float32) * jnp.exp2(-shift)).astype(jnp.float16) for x in qs]
        rescale, dtype = rescale * jnp.exp2(shift), jnp.float16
    m = jnp.full((block_h, block_p), NEG_INF, jnp.float32)
    l = jnp.zeros((block_h, block_p), jnp.float32)
    for offset in range(codes_ref.shape[0]):  # the page's token offsets, unrolled
        j = jnp.int32(offset)
        if ok is None:
            codes, scale = plgpu.load(codes_ref.at[j, pages, :]), plgpu.load(scale_ref.at[j, pages])
        else:
            codes = plgpu.load(codes_ref.at[j, pages, :], mask=ok[:, None], other=0)
            scale = plgpu.load(scale_ref.at[j, pages], mask=ok, other=0.0)
        if bit_unpack:
            lo, hi = _nibbles_as_f16_ptx(codes) if ptx else _nibbles_as_f16(codes)
        else:
            lo, hi = _codes_as(codes, bits, dtype)
        s = plgpu.dot(qs[0], lo, trans_b=True, precision=precision)
        if bits == 4:
            s = s + plgpu.dot(qs[1], hi, trans_b=True, precision=precision)
        s = s * (scale * rescale)[None, :]
        m_new = jnp.maximum(m, s)
        l = l * jnp.exp2(m - m_new) + jnp.exp2(s - m_new)
        m = m_new
    mask = row_ok[:, None] if ok is None else row_ok[:, None] & ok[None, :]
    plgpu.store(o_ref.at[:, pages], (m + jnp.log2(l)) * LN2, mask=mask)


def _page_lse_call(q, codes, scale, *, bits, num_pages, sm_scale, interpret, block_p, num_warps, num_stages,
                   splits):
    hkv, group, d = q.shape
    page, slots, width = codes.shape[1:]
    p = num_pages
    block_h = max(MIN_BLOCK, next_pow2(group))
    part = page // splits
    kernel = functools.partial(_page_lse_kernel, block_p=block_p, group=group, num_pages=p, bits=bits,
                               sm_scale=sm_scale, precision=dot_precision(q.dtype),
                               ptx=not interpret)  # the CPU interpreter runs no inline asm
    lse = pl.pallas_call(
        kernel,
        grid=(-(-p // block_p), hkv, splits),
        in_specs=[
            # The query block is padded past the group to a full tensor-core tile.
            pl.BlockSpec((None, block_h, d), lambda i, h, s: (h, 0, 0)),
            pl.BlockSpec((None, part, slots, width), lambda i, h, s: (h, s, 0, 0)),
            pl.BlockSpec((None, part, slots), lambda i, h, s: (h, s, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_h, p), lambda i, h, s: (s, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, hkv, group, p), jnp.float32),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="sketch_page_lse",
    )(q, codes, scale)
    if splits == 1:
        return lse[0]
    top = functools.reduce(jnp.maximum, list(lse))
    # Added share by share, in order: XLA's CPU reduce over the shares sums in an order that depends on the array's
    # shape, so the heads of requests scored together would not get the bits each gets alone.
    return top + jnp.log(functools.reduce(jnp.add, [jnp.exp(share - top) for share in lse]))


_page_lse_call = interpret_aware_jit(
    _page_lse_call, ("bits", "num_pages", "sm_scale", "interpret", "block_p", "num_warps", "num_stages", "splits"))


def default_launch(num_pages: int, num_kv_heads: int, page_size: int) -> tuple[int, int]:
    """(pages a program, programs sharing a page's offsets) for a sketch of `num_pages` pages.

    Each program walks its offsets one load after another, so the kernel is fastest with 1-2K programs in flight:
    32 pages a program where that alone gives 2048, else 64 with the offsets split in up to 4 (H100,
    `bench/results/runs/h100_sketch_decode_launch/probe_sketch_splits.h100.json`: 30 layers of 32K / 128K / 256K
    tokens in 0.78 / 1.73 / 2.98 ms against 1.05 / 2.09 / 3.41 with 64 pages a program, unsplit)."""
    if -(-num_pages // 32) * num_kv_heads >= 2048:
        return 32, 1
    splits = 1
    while splits < 4 and page_size % (2 * splits) == 0 and -(-num_pages // 64) * num_kv_heads * splits < 1024:
        splits *= 2
    return 64, splits


def hopper_scores_int4_words(q_dtype: jnp.dtype, num_kv_heads: int, group: int, head_dim: int, page_size: int,
                             num_pages: int) -> bool:
    """Whether an int4 sketch of this shape is best stored as words here: the Hopper kernel (`mgpu_sketch`: TMA,
    wgmma) can score it (an sm_90 GPU, a bfloat16 q of head dim 128, G <= 8, whatever `mgpu_sketch.is_supported` asks)
    and the environment does not set JAX_OFFLOAD_HOPPER_ATTENTION=0 (which keeps every attention-side kernel on
    Triton)."""
    if resolve_interpret(None) or not hopper_kernels_allowed():
        return False
    q = jax.ShapeDtypeStruct((num_kv_heads, group, head_dim), q_dtype)
    codes = jax.ShapeDtypeStruct((num_kv_heads, page_size, num_pages, head_dim // 8), jnp.uint32)
    return mgpu_sketch.is_supported(q, codes)


# Pages per tile of `sketch_page_lse_requests`'s tile_starts (the Hopper kernel's CTA).
SKETCH_TILE_PAGES = mgpu_sketch.BLOCK_PAGES


def runs_on_hopper_kernel(codes: jax.Array, *, bits: int) -> bool:
    """Whether `sketch_page_lse` takes the Hopper kernel rather than the Triton one: int4 codes stored as words."""
    return bits == 4 and codes.dtype == jnp.uint32


def sketch_page_lse(q: jax.Array, codes: jax.Array, scale: jax.Array, *, bits: int, num_pages: int | None = None,
                    sm_scale: float | None = None, interpret: bool | None = None, block_p: int | None = None,
                    num_warps: int = 4, num_stages: int = 1, splits: int | None = None,
                    launch_heads: int | None = None) -> jax.Array:
    """Per page and query head, the log-sum-exp of the sketch's estimated attention logits.

    Args:
      q: [Hkv, G, D] query heads grouped by their KV head (bfloat16, float16 or float32).
      codes: [Hkv, page_size, P, width]: bits=4 uint8 bytes with width D / 2 (the Triton kernel) or uint32 words
        with width D / 8 (the Hopper kernel; see the module docstring); bits=8 int8 with width D.
      scale: float32 [Hkv, page_size, P], each token's scale.
      num_pages: score only the first num_pages <= P pages (static; default P). The kernel reads them in place, so
        a sketch allocated for the longest context is never sliced (a slice of its page axis would be a copy).
      sm_scale: default 1/sqrt(D). block_p: pages per program (power of two >= 16).
      splits: programs sharing a page's token offsets (a divisor of page_size), their log-sum-exps combined after.
        block_p and splits default to `default_launch`; the Hopper kernel takes none of the Triton kernel's launch
        parameters.
      launch_heads: the KV heads `default_launch` sizes the launch for (default Hkv): one request's, when several
        requests' heads are stacked on the head axis, so that each is scored with the bits it gets alone.

    Returns:
      float32 [Hkv, G, num_pages]: log sum over each page's tokens of exp((q . codes) * scale * sm_scale).
    """
    if bits not in SKETCH_BITS:
        raise ValueError(f"bits={bits}; allowed: {', '.join(map(str, SKETCH_BITS))}")
    if q.ndim != 3 or codes.ndim != 4 or codes.shape[0] != q.shape[0]:
        raise ValueError(f"q has shape {q.shape} and codes {codes.shape}; allowed: [Hkv, G, D] and "
                         "[Hkv, page_size, P, width]")
    hkv, _, d = q.shape
    page, p = codes.shape[1:3]
    if bits == 4:
        layouts = [(d // 2, jnp.uint8)] + ([(d // 8, jnp.uint32)] if d % 8 == 0 else [])
    else:
        layouts = [(d, jnp.int8)]
    if d % 2 or (codes.shape[3], codes.dtype) not in layouts:
        allowed = " or ".join(f"[{hkv}, page_size, P, {w}] {jnp.dtype(t).name}" for w, t in layouts)
        raise ValueError(f"codes have shape {codes.shape} and dtype {codes.dtype}; allowed for bits={bits} and head "
                         f"dim {d}: {allowed}")
    if scale.shape != (hkv, page, p):
        raise ValueError(f"scale has shape {scale.shape}; allowed: ({hkv}, {page}, {p})")
    num_pages = p if num_pages is None else int(num_pages)
    if not 1 <= num_pages <= p:
        raise ValueError(f"num_pages={num_pages}; allowed: 1 to the sketch's {p} pages")
    if runs_on_hopper_kernel(codes, bits=bits):
        if block_p is not None or splits is not None or resolve_interpret(interpret) or not mgpu_sketch.is_supported(
                q, codes):
            raise ValueError(f"int4 words (codes {codes.shape} uint32) are scored by the Hopper kernel only, which "
                             f"cannot run this call (q {q.shape} {q.dtype}, block_p={block_p}, splits={splits}, "
                             f"interpret={interpret}, on Hopper: {on_hopper()}); store the sketch as bytes")
        return mgpu_sketch.sketch_page_lse_mgpu(q, codes, scale, num_pages=num_pages, sm_scale=sm_scale)
    auto_block, auto_splits = default_launch(num_pages, hkv if launch_heads is None else launch_heads, page)
    block_p = auto_block if block_p is None else block_p
    splits = auto_splits if splits is None else splits
    if splits < 1 or page % splits:
        raise ValueError(f"splits={splits}; allowed: a divisor of the page size {page}")
    return _page_lse_call(q, codes, scale.astype(jnp.float32), bits=bits, num_pages=num_pages,
                          sm_scale=check_sm_scale(sm_scale, d), interpret=resolve_interpret(interpret),
                          block_p=fit_block(block_p, num_pages), num_warps=num_warps, num_stages=num_stages,
                          splits=splits)


def sketch_page_lse_requests(q: jax.Array, codes: jax.Array, scale: jax.Array, *, bits: int, num_pages: int,
                             tile_starts: jax.Array | None = None, sm_scale: float | None = None,
                             interpret: bool | None = None) -> jax.Array:
    """`sketch_page_lse` of R requests sharing one sketch, each the bits it gets alone.

    Args:
      q: [R, Hkv, G, D], each request's query heads grouped by their KV head.
      codes: [Hkv, page_size, P, width] (`sketch_page_lse`'s layouts); scale: float32 [Hkv, page_size, P].
      num_pages: each request's pages (static).
      tile_starts: int32 [R * num_pages / 64] or None. None: the requests lie end to end (P = R * num_pages, request
        r's pages at [r * num_pages, (r + 1) * num_pages)). Otherwise num_pages is a multiple of 64 and the requests'
        pages, cut into tiles of 64 in request order, lie at [tile_starts[t], tile_starts[t] + 64) each (multiples
        of 64).

    Returns:
      float32 [R, Hkv, G, num_pages].

    The Hopper kernel scores them in one launch where they lie when num_pages is a multiple of its tile (64 pages);
    otherwise the tiles are gathered end to end, the requests' pages moved to the head axis and scored as
    `sketch_page_lse` of R * Hkv heads, launched as for one request's Hkv.
    """
    requests, hkv, group, d = q.shape
    page, p = codes.shape[1:3]
    tile = SKETCH_TILE_PAGES
    if tile_starts is None and p != requests * num_pages:
        raise ValueError(f"codes {codes.shape} hold {p} pages; allowed: {requests} requests of num_pages={num_pages}")
    if tile_starts is not None and (num_pages % tile or tile_starts.shape != (requests * num_pages // tile,)):
        raise ValueError(f"tile_starts has shape {tile_starts.shape} for {requests} requests of num_pages="
                         f"{num_pages}; allowed: num_pages a multiple of {tile}, tile_starts "
                         f"({requests * num_pages // tile},)")
    if (runs_on_hopper_kernel(codes, bits=bits) and num_pages % tile == 0
            and not resolve_interpret(interpret) and mgpu_sketch.is_supported(q[0], codes)):
        return mgpu_sketch.sketch_page_lse_requests_mgpu(q, codes, scale, num_pages=num_pages,
                                                         tile_starts=tile_starts, sm_scale=sm_scale)
    if tile_starts is not None:  # gathered end to end, a tile at a time where the sketch is whole tiles
        def end_to_end(x):
            if p % tile:
                return x[:, :, (tile_starts[:, None] + jnp.arange(tile, dtype=tile_starts.dtype)).reshape(-1)]
            by_tile = x.reshape(*x.shape[:2], p // tile, tile, *x.shape[3:])[:, :, tile_starts // tile]
            return by_tile.reshape(*x.shape[:2], requests * num_pages, *x.shape[3:])

        codes, scale = end_to_end(codes), end_to_end(scale)

    def by_head(x):  # [Hkv, page_size, R * N, ...] -> [R * Hkv, page_size, N, ...]
        x = jnp.moveaxis(x.reshape(hkv, page, requests, num_pages, *x.shape[3:]), 2, 0)
        return x.reshape(requests * hkv, page, num_pages, *x.shape[4:])

    lse = sketch_page_lse(q.reshape(requests * hkv, group, d), by_head(codes), by_head(scale), bits=bits,
                          sm_scale=sm_scale, interpret=interpret, launch_heads=hkv)
    return lse.reshape(requests, hkv, group, num_pages)
