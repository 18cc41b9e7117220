"""Where the sketch kernel's time goes, H200, int4, 30 layers of 131,072 and 262,144 tokens (8B shape): the engine's
page-major kernel against stripped copies of it (no softmax; loads only) and a token-major kernel (one dot over a
block of tokens, each page's log-sum-exp by a reshape). Writes probe_sketch_variants.json under $OUT.

    python bench/probes/probe_sketch_variants.py
"""
import functools
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

import pallas_kernels  # noqa: E402
from common import run_metadata  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from probe_sketch_kernel import timed  # noqa: E402

HKV, G, D, PAGE, LAYERS, BH = 8, 4, 128, 16, 30, 16
SM = D ** -0.5


def _unpack(codes):
    u = codes.astype(jnp.int32)
    return ((u & 15) - 8).astype(jnp.bfloat16), ((u >> 4) - 8).astype(jnp.bfloat16)


def page_major(q_ref, codes_ref, scale_ref, o_ref, *, block_p, mode):
    pages = pl.ds(pl.multiple_of(pl.program_id(0) * block_p, block_p), block_p)
    row_ok = jnp.arange(BH) < G
    q_lo = plgpu.load(q_ref.at[:, pl.ds(0, D // 2)], mask=row_ok[:, None], other=0)
    q_hi = plgpu.load(q_ref.at[:, pl.ds(D // 2, D // 2)], mask=row_ok[:, None], other=0)
    m = jnp.full((BH, block_p), -jnp.inf, jnp.float32)
    l = jnp.zeros((BH, block_p), jnp.float32)
    acc = jnp.zeros((block_p, D // 2), jnp.int32)
    for j in range(PAGE):
        j = jnp.int32(j)
        codes, scale = plgpu.load(codes_ref.at[j, pages, :]), plgpu.load(scale_ref.at[j, pages])
        if mode == "loads":
            acc = acc + codes.astype(jnp.int32) + scale.astype(jnp.int32)[:, None]
            continue
        lo, hi = _unpack(codes)
        s = plgpu.dot(q_lo, lo, trans_b=True) + plgpu.dot(q_hi, hi, trans_b=True)
        s = s * (scale * SM)[None, :]
        if mode == "no_softmax":
            m = jnp.maximum(m, s)
            continue
        m_new = jnp.maximum(m, s)
        l = l * jnp.exp(m - m_new) + jnp.exp(s - m_new)
        m = m_new
    if mode == "loads":
        m = m + jnp.sum(acc).astype(jnp.float32)
    elif mode == "no_softmax":
        pass
    else:
        m = m + jnp.log(l)
    plgpu.store(o_ref.at[:, pages], m, mask=row_ok[:, None])


def token_major(q_ref, codes_ref, scale_ref, o_ref, *, block_t):
    start = pl.multiple_of(pl.program_id(0) * block_t, block_t)
    row_ok = jnp.arange(BH) < G
    q_lo = plgpu.load(q_ref.at[:, pl.ds(0, D // 2)], mask=row_ok[:, None], other=0)
    q_hi = plgpu.load(q_ref.at[:, pl.ds(D // 2, D // 2)], mask=row_ok[:, None], other=0)
    codes = plgpu.load(codes_ref.at[pl.ds(start, block_t), :])
    scale = plgpu.load(scale_ref.at[pl.ds(start, block_t)])
    lo, hi = _unpack(codes)
    s = plgpu.dot(q_lo, lo, trans_b=True) + plgpu.dot(q_hi, hi, trans_b=True)
    s = (s * (scale * SM)[None, :]).reshape(BH, block_t // PAGE, PAGE)
    m = jnp.max(s, axis=2)
    lse = m + jnp.log(jnp.sum(jnp.exp(s - m[:, :, None]), axis=2))
    pages = pl.ds(pl.multiple_of(pl.program_id(0) * (block_t // PAGE), block_t // PAGE), block_t // PAGE)
    plgpu.store(o_ref.at[:, pages], lse, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("block_p", "mode", "warps"))
def run_page_major(q, codes, scale, *, block_p, mode, warps):
    p = codes.shape[2]
    return pl.pallas_call(
        functools.partial(page_major, block_p=block_p, mode=mode), grid=(p // block_p, HKV),
        in_specs=[pl.BlockSpec((None, BH, D), lambda i, h: (h, 0, 0)),
                  pl.BlockSpec((None, PAGE, p, D // 2), lambda i, h: (h, 0, 0, 0)),
                  pl.BlockSpec((None, PAGE, p), lambda i, h: (h, 0, 0))],
        out_specs=pl.BlockSpec((None, BH, p), lambda i, h: (h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((HKV, G, p), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=jax.default_backend() != "gpu")(q, codes, scale)


@functools.partial(jax.jit, static_argnames=("block_t", "warps"))
def run_token_major(q, codes, scale, *, block_t, warps):
    t = codes.shape[1]
    return pl.pallas_call(
        functools.partial(token_major, block_t=block_t), grid=(t // block_t, HKV),
        in_specs=[pl.BlockSpec((None, BH, D), lambda i, h: (h, 0, 0)),
                  pl.BlockSpec((None, t, D // 2), lambda i, h: (h, 0, 0)),
                  pl.BlockSpec((None, t), lambda i, h: (h, 0))],
        out_specs=pl.BlockSpec((None, BH, t // PAGE), lambda i, h: (h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((HKV, G, t // PAGE), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=jax.default_backend() != "gpu")(q, codes, scale)


def check():
    """The token-major kernel equals the engine's on one layer of quantized random keys."""
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    q = jax.random.normal(key[0], (HKV, G, D), jnp.bfloat16)
    codes, scale = sketch.quantize_keys(jax.random.normal(key[1], (HKV, 8192, D), jnp.bfloat16), "int4")
    packed = sketch.pack_codes(codes, "int4")
    want = pallas_kernels.sketch_page_lse(q, sketch.to_page_layout(packed, PAGE), sketch.to_page_layout(scale, PAGE),
                                          bits=4)
    got = run_token_major(q, packed, scale, block_t=256, warps=4)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main():
    result = {**run_metadata(), "token_major_rel_err": check(),
              "contexts": {}}
    print(json.dumps(result), flush=True)
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in (131072, 262144):
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        flat_codes = [c.reshape(HKV, tokens, D // 2) for c in codes]  # the same bytes read as token-major
        flat_scales = [s.reshape(HKV, tokens) for s in scales]
        rows = []
        for mode in ("engine", "no_softmax", "loads"):
            for block_p, warps in ((64, 8), (32, 4)):
                fn = jax.jit(lambda q, c, s, b=block_p, m=mode, w=warps: [
                    run_page_major(q[i], c[i], s[i], block_p=b, mode=m, warps=w) for i in range(LAYERS)])
                rows.append({"kernel": f"page_major_{mode}", "block": block_p, "warps": warps,
                             "x30": timed(lambda: fn(q, codes, scales))})
                print(json.dumps(rows[-1]), flush=True)
        for block_t in (128, 256, 512):
            for warps in (4, 8):
                fn = jax.jit(lambda q, c, s, b=block_t, w=warps: [
                    run_token_major(q[i], c[i], s[i], block_t=b, warps=w) for i in range(LAYERS)])
                try:
                    rows.append({"kernel": "token_major", "block": block_t, "warps": warps,
                                 "x30": timed(lambda: fn(q, flat_codes, flat_scales))})
                except Exception as e:  # a block too large for shared memory
                    rows.append({"kernel": "token_major", "block": block_t, "warps": warps,
                                 "error": str(e).splitlines()[0][:200]})
                print(json.dumps(rows[-1]), flush=True)
        nbytes = sum(c.nbytes + s.nbytes for c, s in zip(codes, scales))
        result["contexts"][tokens] = {"hbm_read_ms": nbytes / 4.8e12 * 1e3, "rows": rows}
        del codes, scales, flat_codes, flat_scales
        if "OUT" in os.environ:
            Path(os.environ["OUT"], "probe_sketch_variants.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
