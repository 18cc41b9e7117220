"""Does the sketch kernel's time follow its widening instructions or its resident warpgroups? The Hopper kernel
(pallas_kernels/mgpu_sketch.py) widens each pair of int4 codes to bfloat16 with prmt + lop3 + sub (13 instructions per
8 codes) and keeps all 16 token offsets' tiles of its 64 pages in shared memory (three CTAs an SM). Variants:
- sign magnitude: the codes stored sign-magnitude, each pair of a 32-bit word placed so that one funnel rotate and one
  AND make it a pair of float16 subnormals equal to code * 2^-24 (7 instructions per 8 codes), multiplied by the query
  in float16 (exact for a bfloat16 query within float16's range; the 2^24 goes into the score's scale);
- ring N: N tile slots instead of 16, a slot refilled with the offset N ahead as soon as every thread holds its
  tile in registers, so that more CTAs share an SM (shared memory ~40 KiB a CTA at N = 8).
Checks every kernel against float64 NumPy (group 4 and 8; 8K and 128K tokens less 3 pages), then times them:
Llama-3.1-8B shape, page 16, 30 sparse layers each with its own sketch, at CONTEXTS (default 128K, 256K): GPU time
of one pass over the 30 layers ((t4 - t1) / 3 of programs scoring them once and 4 times, medians of 20 waited
calls), 5 alternated rounds. Writes probe_sketch_widen.json under $OUT.

    MOSAIC_GPU_DUMP_PTXAS=1 python bench/probes/probe_sketch_widen.py
"""
import functools
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402
from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax._src.lib.mlir.dialects import llvm  # noqa: E402

import common  # noqa: E402
from common import run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402
from pallas_kernels._common import LN2, LOG2E, NEG_INF, mosaic_load  # noqa: E402

HKV, G, D, PAGE, LAYERS, PASSES, ROUNDS = 8, 4, 128, 16, 30, 4, 5
CONTEXTS = tuple(int(c) for c in os.environ.get("CONTEXTS", "131072,262144").split(","))
SM_SCALE = 1 / math.sqrt(D)
SUBNORMAL = 2.0 ** 24  # float16's subnormal step is 2^-24
MASK = 0x80078007  # the sign bit and 3 magnitude bits of each float16 half


def pack_sign_magnitude(codes: np.ndarray) -> np.ndarray:
    """int8 codes [..., 128] in [-7, 7] -> uint8 [..., 64]. Word w (bytes 4w..4w+3) holds channels 4w + k (pair k's
    low half) and 64 + 4w + k (its high half), k = 0..3, the same view columns as the two's-complement format, so
    the query's channel order (`mgpu_sketch._wgmma_channels`) is unchanged. Rotating the word right by 4k bits and
    masking with MASK leaves pair k: low magnitude at bits 0-2 and sign at bit 15, high magnitude at 16-18, sign 31."""
    codes = np.asarray(codes, np.int64)
    mag, sign = np.abs(codes), (codes < 0).astype(np.int64)
    words = np.zeros((*codes.shape[:-1], 16), np.uint64)
    for w in range(16):
        for k in range(4):
            lo, hi = 4 * w + k, 64 + 4 * w + k
            r = 4 * k
            fields = ((mag[..., lo], r), (sign[..., lo], (15 + r) % 32), (mag[..., hi], 16 + r),
                      (sign[..., hi], (31 + r) % 32))
            for value, bit in fields:
                words[..., w] |= value.astype(np.uint64) << np.uint64(bit)
    return words.astype(np.uint32).view(np.uint8).reshape(*codes.shape[:-1], 64)


def _widen(tile, dtype=jnp.float16):
    """int4 [64, D] in WGMMA_UPCAST_4X (each register 8 codes of one word) -> float16 [64, D] in WGMMA's layout,
    pair k of a word as the thread's pair in the k-th 8 columns (as `mgpu_sketch._as_wgmma_operand`)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(tile.shape, dtype, layout=plgpu.Layout.WGMMA))
    def widen(_, x):
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get() if dtype == jnp.float16 else ir.BF16Type.get())
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(x.shape), dtype=object)
        for idx, reg in np.ndenumerate(x.registers):
            word = mgpu_utils.bitcast(reg, i32)
            for k in range(4):
                if k == 0:
                    asm = f"and.b32 $0, $1, {MASK};"
                else:
                    asm = f"{{ .reg .b32 t; shf.r.wrap.b32 t, $1, $1, {4 * k}; and.b32 $0, t, {MASK}; }}"
                pair = llvm.inline_asm(i32, [word], asm, "=r,r")
                regs[(idx[0], idx[1] * 4 + k, *idx[2:])] = mgpu_utils.bitcast(pair, f16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return widen(tile)


def _widen_twos_complement(tile):
    return mgpu_sketch._as_wgmma_operand(tile.astype(jnp.bfloat16))


def _kernel(q_ref, codes_ref, scale_ref, out_ref, codes_u8, codes_i4, q_smem, scale_smem, out_smem, ready,
            q_ready, scale_ready, *, batch: int, rescale: float, offsets: int, widen, blocked: bool):
    """`mgpu_sketch._kernel` with a ring of `codes_u8.shape[0]` tile slots (a slot takes offset o + slots as soon as
    every thread holds offset o in registers) and the widening `widen`."""
    block = lax.axis_index("pages")
    head = lax.axis_index("heads")
    pages = pl.ds(block * mgpu_sketch.BLOCK_PAGES, mgpu_sketch.BLOCK_PAGES)
    slots = codes_u8.shape[0]

    def tile(o):  # offset o's codes of this CTA's pages
        return codes_ref.at[head, block, o] if blocked else codes_ref.at[head, o, pages]

    plgpu.copy_gmem_to_smem(q_ref.at[head], q_smem, q_ready)
    plgpu.copy_gmem_to_smem(scale_ref.at[head, block] if blocked else scale_ref.at[head, :, pages], scale_smem,
                            scale_ready)
    for o in range(slots):
        plgpu.copy_gmem_to_smem(tile(o), codes_u8.at[o], ready.at[o])
    wgmma_layout = plgpu.Layout.WGMMA
    shape = (mgpu_sketch.BLOCK_PAGES, 8)
    m = plgpu.layout_cast(jnp.full(shape, NEG_INF, jnp.float32), wgmma_layout)
    l = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    plgpu.barrier_wait(q_ready)
    plgpu.barrier_wait(scale_ready)

    def group(g, carry):
        m, l = carry
        offsets_of_group = [g * batch + i for i in range(batch)]
        slots_of_group = [lax.rem(o, slots) for o in offsets_of_group] if slots < offsets else offsets_of_group
        tiles = []
        for s in slots_of_group:
            plgpu.barrier_wait(ready.at[s])
            tiles.append(widen(mosaic_load(codes_i4.at[s], layout=plgpu.Layout.WGMMA_UPCAST_4X)))
        if slots < offsets:
            plgpu.commit_smem()  # every thread has read these slots: they take the offsets one ring ahead
            for o, s in zip(offsets_of_group, slots_of_group):
                @pl.when(o + slots < offsets)
                def _refill(o=o, s=s):
                    plgpu.copy_gmem_to_smem(tile(o + slots), codes_u8.at[s], ready.at[s])

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
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[head, pages])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def to_blocks(codes, scale):
    """The page layout [Hkv, page, P, ...] -> blocks of 64 pages, each block's tiles contiguous: codes [Hkv, P / 64,
    page, 64, D / 2], scales [Hkv, P / 64, page, 64]."""
    hkv, page, p = scale.shape
    b = mgpu_sketch.BLOCK_PAGES
    return (codes.reshape(hkv, page, p // b, b, -1).transpose(0, 2, 1, 3, 4),
            scale.reshape(hkv, page, p // b, b).transpose(0, 2, 1, 3))


# A bfloat16 subnormal code is code * 2^-133: the query goes in scaled by 2^40 (exact) so that the products stay
# normal float32 numbers, and the score's scale takes 2^93 back.
BF16_SUBNORMAL, BF16_QUERY = 2.0 ** 133, 2.0 ** 40


@functools.partial(jax.jit, static_argnames=("num_pages", "sign_magnitude", "slots", "batch", "blocked", "bf16"))
def ring_launch(q, codes, scale, *, num_pages: int, sign_magnitude: bool, slots: int, batch: int = 2,
                blocked: bool = False, bf16: bool = False):
    hkv, group, d = q.shape
    page = codes.shape[2] if blocked else codes.shape[1]
    blocks = -(-num_pages // mgpu_sketch.BLOCK_PAGES)
    half = d // 2
    q_dtype = jnp.float16 if sign_magnitude and not bf16 else jnp.bfloat16
    q_pad = jnp.pad(q[..., mgpu_sketch._wgmma_channels(d)], ((0, 0), (0, 8 - group), (0, 0)))
    q_pad = q_pad * jnp.bfloat16(BF16_QUERY) if sign_magnitude and bf16 else q_pad.astype(q_dtype)
    subnormal = (BF16_SUBNORMAL / BF16_QUERY if bf16 else SUBNORMAL) if sign_magnitude else 1.0

    def swizzled(shape, dtype, swizzle_bytes):
        elements = swizzle_bytes * 8 // jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else \
            swizzle_bytes // jnp.dtype(dtype).itemsize
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elements)),
                                                    plgpu.SwizzleTransform(swizzle_bytes)))

    slots = min(slots, page)
    codes_smem = plgpu.RefUnion(swizzled((slots, mgpu_sketch.BLOCK_PAGES, half), jnp.uint8, half),
                                swizzled((slots, mgpu_sketch.BLOCK_PAGES, d), jnp.int4, half))
    kernel = functools.partial(
        _kernel, batch=batch, offsets=page, blocked=blocked,
        widen=functools.partial(_widen, dtype=q_dtype) if sign_magnitude else _widen_twos_complement,
        rescale=SM_SCALE * LOG2E * subnormal)
    out = plgpu.kernel(
        lambda q_ref, c_ref, s_ref, o_ref, views, *rest: kernel(q_ref, c_ref, s_ref, o_ref, *views, *rest),
        out_type=jax.ShapeDtypeStruct((hkv, blocks * mgpu_sketch.BLOCK_PAGES, 8), jnp.float32),
        scratch_types=(
            codes_smem,
            swizzled((8, d), q_dtype, 128),
            plgpu.SMEM((page, mgpu_sketch.BLOCK_PAGES), jnp.float32),
            plgpu.SMEM((mgpu_sketch.BLOCK_PAGES, 8), jnp.float32),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(),
            plgpu.Barrier(),
        ),
        grid=(blocks, hkv),
        grid_names=("pages", "heads"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q_pad, codes, scale)
    return jnp.moveaxis(out[:, :num_pages, :group], 2, 1)


def engine_launch(q, codes, scale, *, num_pages: int):
    return mgpu_sketch._launch(q, codes, scale, num_pages=num_pages, sm_scale=SM_SCALE)


def _twos(c):
    return sketch.pack_codes(jnp.asarray(c), "int4")


def _sm(c):
    return jnp.asarray(pack_sign_magnitude(np.asarray(c)))


def _ring(sign_magnitude: bool, slots: int, batch: int = 2, blocked: bool = False, bf16: bool = False):
    return functools.partial(ring_launch, sign_magnitude=sign_magnitude, slots=slots, batch=batch, blocked=blocked,
                             bf16=bf16)


KERNELS = {
    "engine": (engine_launch, _twos),
    "sign_magnitude_ring_4": (_ring(True, 4), _sm),
    "sign_magnitude_bf16_ring_4": (_ring(True, 4, bf16=True), _sm),
    "sign_magnitude_bf16_16": (_ring(True, 16, bf16=True), _sm),
    "sign_magnitude_bf16_ring_2_batch_1": (_ring(True, 2, 1, bf16=True), _sm),
}
BLOCKED = {name for name in KERNELS if name.endswith("_blocked")}


def check(group: int, tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t = tokens - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    q = jnp.asarray(rng.standard_normal((HKV, group, D)) * 4, jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, group, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    extra = tokens // PAGE + 64 - t // PAGE
    errs = {}
    for name, (fn, pack) in KERNELS.items():
        packed = sketch.to_page_layout(pack(codes), PAGE)
        padded = (jnp.pad(packed, ((0, 0), (0, 0), (0, extra), (0, 0)), constant_values=0x5A),
                  jnp.pad(sketch.to_page_layout(scale, PAGE), ((0, 0), (0, 0), (0, extra)), constant_values=7.0))
        if name in BLOCKED:
            padded = to_blocks(*padded)
        got = np.asarray(fn(q, *padded, num_pages=t // PAGE), np.float64)
        errs[name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    return {"seed": seed, "group": group, "tokens": tokens, "rel_err": errs, "ok": max(errs.values()) < 1e-6}


def main():
    result = {**run_metadata(), "checks_vs_float64": [], "contexts": {}}
    path = Path(os.environ.get("OUT", "."), "probe_sketch_widen.json")
    for args in ((4, 8192, 11), (8, 8192, 12), (4, 131072, 13)):
        try:
            result["checks_vs_float64"].append(check(*args))
        except Exception as e:  # keep the timing even if a check cannot run
            result["checks_vs_float64"].append({"args": args, "error": repr(e)[-3000:]})
        print(json.dumps(result["checks_vs_float64"][-1]), flush=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        blocked = [to_blocks(c, s) for c, s in zip(codes, scales)]
        inputs = {name: ([b[0] for b in blocked], [b[1] for b in blocked]) if name in BLOCKED else (codes, scales)
                  for name in KERNELS}
        runs = {(name, r): jax.jit(lambda q, c, s, f=f, r=r: [
            f(q[i] + jnp.bfloat16(j), c[i], s[i], num_pages=pages) for j in range(r) for i in range(LAYERS)])
            for name, (f, _) in KERNELS.items() for r in (1, PASSES)}
        for name in KERNELS:
            jax.block_until_ready(runs[name, 1](q, *inputs[name]))
        per_pass = {name: [] for name in KERNELS}
        for _ in range(ROUNDS):
            for name in KERNELS:
                once, repeated = (lambda name=name, r=r: runs[name, r](q, *inputs[name]) for r in (1, PASSES))
                per_pass[name].append(common.gpu_ms_per_pass(once, repeated, PASSES, 20))
            print(tokens, json.dumps(per_pass), flush=True)
        result["contexts"][str(tokens)] = {
            "sketch_bytes_30_layers": sum(c.nbytes + s.nbytes for c, s in zip(codes, scales)),
            "gpu_ms_per_pass_of_30_layers": {n: stats(v) for n, v in per_pass.items()}, "rounds": per_pass}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales, runs, blocked, inputs


if __name__ == "__main__":
    main()
