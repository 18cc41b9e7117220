"""Sketch scoring with the sketch in token order and a program's whole tile in one load (issue 24), on the GPU.

The engine's kernel (`pallas_kernels.sketch`) keeps the sketch as [Hkv, page_size, P, width] and walks a program's
16 token offsets one load and one small dot after another, a chain through the running max and sum. Here the sketch
stays in token order, [Hkv, T, width]: a program's block of pages is one contiguous tile (block_p x 16 tokens),
loaded at once, unpacked, multiplied with the query group in one dot per nibble half ([16, D/2] x [D/2, tokens]),
then reshaped to [16, block_p, 16] and reduced over each page's 16 tokens (max, then the sum of exp2). Same
arithmetic per token; only the order of the sum within a page differs.

Llama-3.1-8B shape (8 KV heads, 4 query heads each, D 128), page 16, 30 layers each with its own random int4 sketch,
at 32K, 128K and 256K: the engine's kernel at its default launch against this one over (pages a program, warps), 30
layers in one program. Checks against float64 NumPy on the GPU first. Median, min, max of 20 calls after a warm-up.
Writes probe_sketch_token_order.json under $OUT.

    python bench/probes/probe_sketch_token_order.py
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
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

import pallas_kernels  # noqa: E402
from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels._common import LN2, LOG2E, compiler_params, resolve_interpret  # noqa: E402
from pallas_kernels.sketch import _nibbles_as_f16, _nibbles_as_f16_ptx  # noqa: E402

HKV, G, D, PAGE, LAYERS = 8, 4, 128, 16, 30
CONTEXTS = (32768, 131072, 262144)
CONFIGS = [(32, 4), (16, 4), (32, 8), (64, 8), (8, 4)]
HBM_BYTES_PER_S = 3.35e12  # H100 SXM


def _kernel(q_ref, codes_ref, scale_ref, o_ref, *, block_p, group, sm_scale, ptx):
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    half = codes_ref.shape[-1]
    qs = [plgpu.load(q_ref.at[:, pl.ds(i * half, half)], mask=row_ok[:, None], other=0).astype(jnp.float32)
          for i in (0, 1)]
    top = jnp.maximum(jnp.max(jnp.abs(qs[0])), jnp.max(jnp.abs(qs[1])))
    shift = jnp.maximum(jnp.ceil(jnp.log2(jnp.maximum(top, 1e-30))) - 14.0, 0.0)
    qs = [(x * jnp.exp2(-shift)).astype(jnp.float16) for x in qs]
    rescale = sm_scale * LOG2E * jnp.exp2(shift)
    codes = plgpu.load(codes_ref)  # [block_p * PAGE, D/2], one contiguous tile
    lo, hi = _nibbles_as_f16_ptx(codes) if ptx else _nibbles_as_f16(codes)
    s = plgpu.dot(qs[0], lo, trans_b=True) + plgpu.dot(qs[1], hi, trans_b=True)  # [block_h, tokens]
    s = s * (plgpu.load(scale_ref) * rescale)[None, :]
    s = s.reshape(block_h, block_p, PAGE)
    m = jnp.max(s, axis=2)
    lse = m + jnp.log2(jnp.sum(jnp.exp2(s - m[:, :, None]), axis=2))
    plgpu.store(o_ref, lse * LN2, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("block_p", "num_warps", "interpret"))
def page_lse_token_order(q, codes, scale, *, block_p, num_warps=4, interpret=False):
    """q [Hkv, G, D] bf16; codes uint8 [Hkv, T, D/2] (token order); scale f32 [Hkv, T] -> f32 [Hkv, G, T/16]."""
    hkv, group, d = q.shape
    t = codes.shape[1]
    p = t // PAGE
    block_h = 16
    tile = block_p * PAGE
    return pl.pallas_call(
        functools.partial(_kernel, block_p=block_p, group=group, sm_scale=1.0 / math.sqrt(d), ptx=not interpret),
        grid=(p // block_p, hkv),
        in_specs=[pl.BlockSpec((None, block_h, d), lambda i, h: (h, 0, 0)),
                  pl.BlockSpec((None, tile, d // 2), lambda i, h: (h, i, 0)),
                  pl.BlockSpec((None, tile), lambda i, h: (h, i))],
        out_specs=pl.BlockSpec((None, block_h, block_p), lambda i, h: (h, 0, i)),
        out_shape=jax.ShapeDtypeStruct((hkv, group, p), jnp.float32),
        compiler_params=compiler_params(num_warps, 1),
        interpret=resolve_interpret(interpret),
        name="sketch_page_lse_token_order",
    )(q, codes, scale)


def timed(fn, reps=20):
    s = stats([t * 1e3 for t in call_seconds(fn, reps)])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def check(interpret=False):
    """Max |kernel - float64| / max |float64|, both kernels (8K tokens)."""
    rng = np.random.default_rng(11)
    t = 8192
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    packed = sketch.pack_codes(codes, "int4")
    q = jnp.asarray(rng.standard_normal((HKV, G, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, G, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    out = {}
    for b, w in CONFIGS[:2]:
        got = np.asarray(page_lse_token_order(q, packed, scale, block_p=b, num_warps=w, interpret=interpret))
        out[f"token_order_{b}x{w}"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    if not interpret:
        stored = (sketch.to_page_layout(packed, PAGE), sketch.to_page_layout(scale, PAGE))
        got = np.asarray(pallas_kernels.sketch_page_lse(q, *stored, bits=4), np.float64)
        out["engine"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    return out


def main():
    if "--cpu" in sys.argv:
        print(json.dumps(check(interpret=True)))
        return
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    result = {**run_metadata(), "kv_heads": HKV, "group": G, "head_dim": D, "page": PAGE, "layers": LAYERS,
              "check_max_rel_err_vs_float64": check(), "contexts": {}}
    print(json.dumps(result["check_max_rel_err_vs_float64"]), flush=True)
    path = Path(os.environ.get("OUT", "."), "probe_sketch_token_order.json")
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, tokens, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, tokens), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        nbytes = sum(c.nbytes + s.nbytes for c, s in zip(codes, scales))
        paged_codes = [sketch.to_page_layout(c, PAGE) for c in codes]
        paged_scales = [sketch.to_page_layout(s, PAGE) for s in scales]
        engine = jax.jit(lambda q, c, s: [pallas_kernels.sketch_page_lse(q[i], c[i], s[i], bits=4)
                                          for i in range(LAYERS)])
        rows = [{"kernel": "engine (page layout, default launch)", "x30": timed(lambda: engine(q, paged_codes,
                                                                                               paged_scales))}]
        print(tokens, json.dumps(rows[-1]), flush=True)
        same = [np.asarray(x) for x in engine(q, paged_codes, paged_scales)[:2]]
        del paged_codes, paged_scales
        for b, w in CONFIGS:
            run = jax.jit(lambda q, c, s, b=b, w=w: [page_lse_token_order(q[i], c[i], s[i], block_p=b, num_warps=w)
                                                     for i in range(LAYERS)])
            try:
                got = [np.asarray(x) for x in run(q, codes, scales)[:2]]
                diff = max(float(np.max(np.abs(g - e))) for g, e in zip(got, same))
                rows.append({"kernel": "token order", "block_p": b, "num_warps": w,
                             "max_abs_diff_vs_engine": diff, "x30": timed(lambda: run(q, codes, scales))})
            except Exception as e:  # noqa: BLE001
                rows.append({"kernel": "token order", "block_p": b, "num_warps": w, "error": str(e)[:300]})
            print(tokens, json.dumps(rows[-1]), flush=True)
        result["contexts"][str(tokens)] = {"sketch_bytes_30_layers": nbytes,
                                           "hbm_read_ms": nbytes / HBM_BYTES_PER_S * 1e3, "rows": rows}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales


if __name__ == "__main__":
    main()
