"""Issue 24's missed target (sketch scoring <= 2 ms for 30 layers at 128K and 256K): does Triton's software pipeliner
help the page log-sum-exp kernel? Not run on a GPU yet (written 2026-11-25 on the CPU, checked there in interpret
mode).

`pallas_kernels/sketch.py` unrolls its loop over a page's 16 token offsets in Python, so Triton sees straight-line
code with no loop to pipeline, and its `num_stages` does nothing; its loads alone ran at ~40% of HBM bandwidth
(`probe_sketch_variants.h200.json`) and loading tiles ahead by hand did not help (`probe_sketch_lookahead`). Here
the same arithmetic runs in a `lax.fori_loop` (an scf.for), whose loads Triton can issue `num_stages - 1`
iterations ahead (cp.async into shared memory), as its int4-dequantizing matmuls do. The probe checks the variant
against the jnp reference, then times, for the 8B shape (8 KV heads, 4 query heads each, head dim 128, page 16,
int4) at 128K and 256K, 30 layers each with its own sketch in one program (median, min, max of 20 calls after a
warm-up): the engine's kernel at its best launch (64 pages a program, 8 warps) and the pipelined one over pages a
program x warps x stages; and the page mass (the kernel, the softmax over pages, the sum over the group) at the
variant's best. Writes probe_sketch_pipeline.json under $OUT (or --out).

    python bench/probes/probe_sketch_pipeline.py
    JAX_PLATFORMS=cpu python bench/probes/probe_sketch_pipeline.py --check-only    # interpret mode, small
"""
import argparse
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

import pallas_kernels  # noqa: E402
from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels._common import LN2, LOG2E, MIN_BLOCK, NEG_INF, compiler_params, next_pow2  # noqa: E402
from pallas_kernels.sketch import _nibbles_as_f16  # noqa: E402

HKV, G, D, PAGE, LAYERS = 8, 4, 128, 16, 30
CONTEXTS = (131072, 262144)


def _pipelined_kernel(q_ref, codes_ref, scale_ref, o_ref, *, block_p: int, group: int, sm_scale: float):
    """`pallas_kernels.sketch._page_lse_kernel` for int4 codes and a 16-bit q, its offsets in a loop."""
    pages = pl.ds(pl.multiple_of(pl.program_id(0) * block_p, block_p), block_p)
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    half = codes_ref.shape[-1]
    qs = [plgpu.load(q_ref.at[:, pl.ds(i * half, half)], mask=row_ok[:, None], other=0) for i in (0, 1)]
    top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in qs])
    shift = jnp.maximum(jnp.ceil(jnp.log2(jnp.maximum(top, 1e-30))) - 14.0, 0.0)
    qs = [(x.astype(jnp.float32) * jnp.exp2(-shift)).astype(jnp.float16) for x in qs]
    rescale = sm_scale * LOG2E * jnp.exp2(shift)

    def offset(j, carry):
        m, l = carry
        lo, hi = _nibbles_as_f16(plgpu.load(codes_ref.at[j, pages, :]))
        s = plgpu.dot(qs[0], lo, trans_b=True) + plgpu.dot(qs[1], hi, trans_b=True)
        s = s * (plgpu.load(scale_ref.at[j, pages]) * rescale)[None, :]
        m_new = jnp.maximum(m, s)
        return m_new, l * jnp.exp2(m - m_new) + jnp.exp2(s - m_new)

    m, l = lax.fori_loop(0, codes_ref.shape[0], offset, (jnp.full((block_h, block_p), NEG_INF, jnp.float32),
                                                        jnp.zeros((block_h, block_p), jnp.float32)))
    plgpu.store(o_ref.at[:, pages], (m + jnp.log2(l)) * LN2, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("block_p", "num_warps", "num_stages", "interpret"))
def pipelined_page_lse(q, codes, scale, *, block_p: int, num_warps: int, num_stages: int, interpret: bool = False):
    """As `pallas_kernels.sketch_page_lse(q, codes, scale, bits=4)` for page counts that are multiples of block_p."""
    hkv, group, d = q.shape
    page, p, width = codes.shape[1:]
    block_h = max(MIN_BLOCK, next_pow2(group))
    kernel = functools.partial(_pipelined_kernel, block_p=block_p, group=group, sm_scale=d ** -0.5)
    return pl.pallas_call(
        kernel, grid=(p // block_p, hkv),
        in_specs=[pl.BlockSpec((None, block_h, d), lambda i, h: (h, 0, 0)),
                  pl.BlockSpec((None, page, p, width), lambda i, h: (h, 0, 0, 0)),
                  pl.BlockSpec((None, page, p), lambda i, h: (h, 0, 0))],
        out_specs=pl.BlockSpec((None, block_h, p), lambda i, h: (h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((hkv, group, p), jnp.float32),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="sketch_page_lse_pipelined")(q, codes, scale)


def timed(fn, reps=20):
    s = stats([t * 1e3 for t in call_seconds(fn, reps)])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def check(tokens: int, interpret: bool) -> float:
    """Largest relative difference of the pipelined kernel from the jnp reference of the engine's sketch."""
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    q = jax.random.normal(key[0], (HKV, G, D), jnp.bfloat16)
    k = jax.random.normal(key[1], (HKV, tokens, D), jnp.bfloat16)
    codes, scale = sketch.quantize_keys(k, "int4")
    want = sketch.page_lse(sketch.token_scores(q, sketch.pack_codes(codes, "int4"), scale, "int4"), PAGE)
    packed = sketch.to_page_layout(sketch.pack_codes(codes, "int4"), PAGE)
    got = pipelined_page_lse(q, packed, sketch.to_page_layout(scale, PAGE), block_p=32, num_warps=4, num_stages=3,
                             interpret=interpret)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = p.parse_args()
    interpret = jax.default_backend() != "gpu"
    result = {**run_metadata(), "max_rel_err_vs_jnp": check(2048 if interpret else 8192, interpret)}
    print(json.dumps(result), flush=True)
    if a.check_only or result["max_rel_err_vs_jnp"] > 1e-3:
        return 0 if result["max_rel_err_vs_jnp"] <= 1e-3 else 1
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    result["contexts"] = {}
    for tokens in CONTEXTS:
        pages = tokens // PAGE
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        engine = jax.jit(lambda q, c, s: [pallas_kernels.sketch_page_lse(q[i], c[i], s[i], bits=4, block_p=64,
                                                                         num_warps=8) for i in range(LAYERS)])
        row = {"engine_kernel_64p_8w": timed(lambda: engine(q, codes, scales)), "pipelined": []}
        for block_p in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    fn = jax.jit(lambda q, c, s, b=block_p, w=warps, n=stages: [pipelined_page_lse(
                        q[i], c[i], s[i], block_p=b, num_warps=w, num_stages=n) for i in range(LAYERS)])
                    try:
                        t = timed(lambda: fn(q, codes, scales))
                    except Exception as e:  # a launch that does not fit (shared memory, registers) is a result too
                        t = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    row["pipelined"].append({"block_p": block_p, "num_warps": warps, "num_stages": stages, **t})
        ok = [r for r in row["pipelined"] if "median_ms" in r]
        best = min(ok, key=lambda r: r["median_ms"]) if ok else None
        if best:
            num_pages = jnp.int32(pages)
            mass = jax.jit(lambda q, c, s: [sketch.mass_of_pages(pipelined_page_lse(
                q[i], c[i], s[i], block_p=best["block_p"], num_warps=best["num_warps"],
                num_stages=best["num_stages"]), num_pages) for i in range(LAYERS)])
            row["best"], row["page_mass_x30_at_best"] = best, timed(lambda: mass(q, codes, scales))
        result["contexts"][str(tokens)] = row
        print(tokens, json.dumps({k: v for k, v in row.items() if k != "pipelined"}), flush=True)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "probe_sketch_pipeline.json").write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales
    return 0


if __name__ == "__main__":
    sys.exit(main())
