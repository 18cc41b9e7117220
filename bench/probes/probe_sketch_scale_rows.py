"""Sketch scoring with each program's token scales in one load, on the GPU.

`pallas_kernels/sketch.py` loads, for each of a page's 16 token offsets, that offset's codes of its block of pages
and their 16 scales: 32 small loads a program, one after another, and the kernel's time follows the programs in
flight. Here the scales are laid out [Hkv, P, page_size] (a page's scales contiguous) and a program loads its
[pages, offsets] tile of them once, taking each offset's column in registers: 17 loads instead of 32. Same
arithmetic otherwise. Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim 128), page 16, int4, 30 layers each
with its own random sketch in one program, the engine's launch (`default_launch`), at 32K, 128K and 256K, against
the engine's kernel on the same codes; float64 check of both first. Median, min, max of 20 calls after a warm-up,
alternated twice. Writes probe_sketch_scale_rows.json under $OUT (or --out).

    python bench/probes/probe_sketch_scale_rows.py
    JAX_PLATFORMS=cpu python bench/probes/probe_sketch_scale_rows.py --check-only   # interpret mode, small
"""
import argparse
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
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

import pallas_kernels  # noqa: E402
from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels._common import LN2, LOG2E, MIN_BLOCK, NEG_INF, compiler_params, dot_precision, next_pow2  # noqa: E402
from pallas_kernels.sketch import _nibbles_as_f16, _nibbles_as_f16_ptx, default_launch  # noqa: E402

HKV, G, D, PAGE, LAYERS = 8, 4, 128, 16, 30
CONTEXTS = (32768, 131072, 262144)


def _kernel(q_ref, codes_ref, scale_ref, o_ref, *, block_p, group, num_pages, sm_scale, precision, ptx):
    start = pl.multiple_of(pl.program_id(0) * block_p, block_p)
    pages = pl.ds(start, block_p)
    ok = start + jnp.arange(block_p, dtype=jnp.int32) < num_pages if num_pages % block_p else None
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    half = codes_ref.shape[-1]
    qs = [plgpu.load(q_ref.at[:, pl.ds(i * half, half)], mask=row_ok[:, None], other=0) for i in (0, 1)]
    top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in qs])
    shift = jnp.maximum(jnp.ceil(jnp.log2(jnp.maximum(top, 1e-30))) - 14.0, 0.0)
    qs = [(x.astype(jnp.float32) * jnp.exp2(-shift)).astype(jnp.float16) for x in qs]
    rescale = sm_scale * LOG2E * jnp.exp2(shift)
    part = codes_ref.shape[0]
    if ok is None:
        scales = plgpu.load(scale_ref.at[pages, :])  # [block_p, part]: every offset's scales in one load
    else:
        scales = plgpu.load(scale_ref.at[pages, :], mask=ok[:, None], other=0.0)
    cols = jnp.arange(part, dtype=jnp.int32)[None, :]
    m = jnp.full((block_h, block_p), NEG_INF, jnp.float32)
    l = jnp.zeros((block_h, block_p), jnp.float32)
    for offset in range(part):
        j = jnp.int32(offset)
        if ok is None:
            codes = plgpu.load(codes_ref.at[j, pages, :])
        else:
            codes = plgpu.load(codes_ref.at[j, pages, :], mask=ok[:, None], other=0)
        lo, hi = _nibbles_as_f16_ptx(codes) if ptx else _nibbles_as_f16(codes)
        s = plgpu.dot(qs[0], lo, trans_b=True, precision=precision) + plgpu.dot(qs[1], hi, trans_b=True,
                                                                                 precision=precision)
        scale = jnp.sum(jnp.where(cols == offset, scales, 0.0), axis=1)
        s = s * (scale * rescale)[None, :]
        m_new = jnp.maximum(m, s)
        l = l * jnp.exp2(m - m_new) + jnp.exp2(s - m_new)
        m = m_new
    mask = row_ok[:, None] if ok is None else row_ok[:, None] & ok[None, :]
    plgpu.store(o_ref.at[:, pages], (m + jnp.log2(l)) * LN2, mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def scale_rows_lse(q, codes, scale_rows, interpret=False):
    """q [Hkv, G, D] bf16, codes [Hkv, page, P, D/2] uint8, scale_rows [Hkv, P, page] float32 -> [Hkv, G, P]."""
    hkv, group, d = q.shape
    page, p, width = codes.shape[1:]
    block_p, splits = default_launch(p, hkv, page)
    block_p = min(block_p, max(MIN_BLOCK, next_pow2(p)))
    part = page // splits
    kernel = functools.partial(_kernel, block_p=block_p, group=group, num_pages=p, sm_scale=1 / math.sqrt(d),
                               precision=dot_precision(q.dtype), ptx=not interpret)
    lse = pl.pallas_call(
        kernel, grid=(-(-p // block_p), hkv, splits),
        in_specs=[pl.BlockSpec((None, max(MIN_BLOCK, next_pow2(group)), d), lambda i, h, s: (h, 0, 0)),
                  pl.BlockSpec((None, part, p, width), lambda i, h, s: (h, s, 0, 0)),
                  pl.BlockSpec((None, p, part), lambda i, h, s: (h, 0, s))],
        out_specs=pl.BlockSpec((None, None, max(MIN_BLOCK, next_pow2(group)), p), lambda i, h, s: (s, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, hkv, group, p), jnp.float32),
        compiler_params=compiler_params(4, 1), interpret=interpret, name="sketch_page_lse_scale_rows",
    )(q, codes, scale_rows)
    if splits == 1:
        return lse[0]
    top = jnp.max(lse, axis=0)
    return top + jnp.log(jnp.sum(jnp.exp(lse - top), axis=0))


def check(interpret: bool) -> dict:
    rng = np.random.default_rng(13)
    t = (2048 if interpret else 8192) - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    packed = sketch.to_page_layout(sketch.pack_codes(codes, "int4"), PAGE)
    q = jnp.asarray(rng.standard_normal((HKV, G, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, G, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    engine = np.asarray(pallas_kernels.sketch_page_lse(q, packed, sketch.to_page_layout(scale, PAGE), bits=4,
                                                       interpret=interpret), np.float64)
    rows = np.asarray(scale_rows_lse(q, packed, scale.reshape(HKV, t // PAGE, PAGE), interpret=interpret), np.float64)
    err = lambda x: float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))  # noqa: E731
    return {"engine": err(engine), "scale_rows": err(rows), "bitwise_equal": bool(np.array_equal(engine, rows))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    result = {"meta": run_metadata(), "max_rel_err_vs_float64": check(args.check_only)}
    print(result["max_rel_err_vs_float64"], flush=True)
    if not args.check_only:
        keys = iter(jax.random.split(jax.random.key(0), 3 * LAYERS * len(CONTEXTS)))
        for ctx in CONTEXTS:
            p = ctx // PAGE
            codes = [jax.random.bits(next(keys), (HKV, PAGE, p, D // 2), jnp.uint8) for _ in range(LAYERS)]
            scales = [jax.random.uniform(next(keys), (HKV, PAGE, p)) * 0.1 for _ in range(LAYERS)]
            rows = [jnp.swapaxes(s, 1, 2) for s in scales]
            q = jax.random.normal(next(keys), (HKV, G, D), jnp.bfloat16)
            engine = jax.jit(lambda q, c, s: [pallas_kernels.sketch_page_lse(q, ci, si, bits=4) for ci, si in zip(c, s)])
            variant = jax.jit(lambda q, c, s: [scale_rows_lse(q, ci, si) for ci, si in zip(c, s)])
            row = result.setdefault("contexts", {}).setdefault(str(ctx), {})
            row["bitwise_equal"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(engine(q, codes, scales),
                                                                                   variant(q, codes, rows)))
            for name, fn, s in (("engine", engine, scales), ("scale_rows", variant, rows)) * 2:
                st = stats([t * 1e3 for t in call_seconds(lambda: fn(q, codes, s), 20)])
                row.setdefault(name, []).append({"median_ms": st["median"], "min_ms": st["min"], "max_ms": st["max"]})
                print(ctx, name, f"{st['median']:.3f} ms ({st['min']:.3f}-{st['max']:.3f})", flush=True)
            print(ctx, "bitwise equal", row["bitwise_equal"], flush=True)
            del codes, scales, rows
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "probe_sketch_scale_rows.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
