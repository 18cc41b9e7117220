"""Can decode-size matmuls sum K in one pass and stay at cuBLAS's speed (issue 64)? If they can, the batch-invariant
order needs no 1,024-key chunks, and prefill and decode-batch tiles hold one float32 accumulator instead of two (JAX's
one-pass Hopper matmul runs the 8B's projections at 8,192 rows at 1.03x cuBLAS, our two-accumulator form at 1.17x:
bench/results/runs/h200_invariant_price/). The chunks exist for the one-row matmul, which takes a program per chunk of
K to keep enough of a deep, narrow weight in flight; the Triton form without them took w_down 45 us against cuBLAS's 32
(bench/results/runs/h200_matmul_decode/).

This probe's kernel (`gemv_t`, Mosaic GPU): one CTA per 64 or 128 columns of w streams w's [64 keys, columns] tiles
through a deep TMA ring (6-12 slots, up to 96 KiB in flight a CTA), one consumer warpgroup multiplies each tile,
transposed, by x's tile (the rows padded to 8): acc [columns, 8] += w_tile^T @ x_tile^T on warpgroup MMA, one pass
over K in ascending 64-key tiles, rounded once; x @ w is acc's transpose.

For each Llama-3.1-8B projection at ROWS (default 1, 4), us a matmul (16 weights a program, 10 programs back to
back, median of 7 loops with min-max): cuBLAS, the engine's chunked Triton form (today's bits), the Triton form in one
pass (K_CHUNK past K: the one-pass order's bits), and `gemv_t` at each (columns, slots); and whether `gemv_t`'s bits
equal the one-pass Triton form's (the wgmma's sums taken with w as the left operand must match the dot's with x as
the left one for the order to hold across forms). Then at BATCH_ROWS (default 128, 256, 8192; 4 weights a program
past 512 rows) what one pass would give decode batches and prefill: cuBLAS, the engine's chunked form (the warpgroup
form where `wgmma_suits` sends it), and JAX's one-pass Hopper matmul (one float32 accumulator a warpgroup) at a few
tile shapes, its bits checked against the one-pass Triton form's.

    python bench/probes/probe_gemv_one_pass.py          # writes probe_gemv_one_pass.json under $OUT
"""
import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from common import probe_output, run_metadata, stats  # noqa: E402

triton_matmul = importlib.import_module("pallas_kernels.matmul")  # the package's `matmul` attribute is the function

SHAPES = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672), "w_down": (14336, 4096)}
ROWS = [int(m) for m in os.environ.get("ROWS", "1,4").split(",") if m]
BATCH_ROWS = [int(m) for m in os.environ.get("BATCH_ROWS", "128,256,8192").split(",") if m]
BATCH_TILES = [(64, 64), (64, 128), (128, 128)]  # JAX's kernel: a warpgroup's tile, two side by side a CTA
CONFIGS = [(64, 6), (64, 8), (64, 12), (128, 6), (128, 8)]  # (columns a CTA, ring slots)
LAYERS, CALLS, LOOPS = 16, 10, 7
BLOCK_K, PADDED_ROWS = 64, 8


def _swizzled(elems_per_row: int):
    return (plgpu.TilingTransform((8, elems_per_row)), plgpu.SwizzleTransform(128))


def _kernel(x_gmem, w_gmem, o_gmem, o_smem, *, tile_n: int, steps: int, interpret: bool):
    cols = pl.ds(lax.axis_index("tile") * tile_n, tile_n)

    def step(idxs, w_smem, x_smem, acc):
        if interpret:  # the CPU interpreter takes no register accumulator
            return acc + lax.dot(w_smem[...].T, x_smem[...].T, preferred_element_type=jnp.float32)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem, (1, 0)), plgpu.transpose_ref(x_smem, (1, 0)))

        return pl.run_state(mma)(plgpu.ACC.init(acc))

    def compute(run_pipeline):
        zero = jnp.zeros((tile_n, PADDED_ROWS), jnp.float32)
        acc = run_pipeline(zero if interpret else plgpu.layout_cast(zero, plgpu.Layout.WGMMA))
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[cols, :])
        plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(x_gmem.shape[1] // BLOCK_K,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((BLOCK_K, tile_n), lambda t: (t, 0), transforms=_swizzled(64)),
                  plgpu.BlockSpec((PADDED_ROWS, BLOCK_K), lambda t: (0, t), transforms=_swizzled(BLOCK_K))],
        wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=steps, compute_context=compute)
    pipeline(w_gmem.at[:, cols], x_gmem)


@functools.partial(jax.jit, static_argnames=("tile_n", "steps", "interpret"))
def gemv_t(x, w, *, tile_n: int = 64, steps: int = 8, interpret: bool = False):
    """x [m <= 8, K] @ w [K, N] in x's dtype, K in one pass of 64-key tiles."""
    from pallas_kernels._common import mosaic_interpret_params

    m, n = x.shape[0], w.shape[1]
    out = plgpu.kernel(
        functools.partial(_kernel, tile_n=tile_n, steps=steps, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((n, PADDED_ROWS), jnp.float32),
        scratch_types=(plgpu.SMEM((tile_n, PADDED_ROWS), jnp.float32),),
        grid=(n // tile_n,), grid_names=("tile",), num_threads=2, thread_name="wg",
        interpret=mosaic_interpret_params() if interpret else None,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(jnp.pad(x, ((0, PADDED_ROWS - m), (0, 0))), w)
    return out.T[:m].astype(x.dtype)


def per_matmul_us(fn, x, ws) -> dict:
    jax.block_until_ready(fn(x, ws))
    samples = []
    for _ in range(LOOPS):
        t = time.perf_counter()
        jax.block_until_ready([fn(x, ws) for _ in range(CALLS)])
        samples.append((time.perf_counter() - t) * 1e6 / (CALLS * len(ws)))
    return stats(samples)


def program(mm):
    return jax.jit(lambda x, ws: [mm(x, w) for w in ws])


same = jax.jit(lambda a, b: jnp.all(lax.bitcast_convert_type(a, jnp.uint16) == lax.bitcast_convert_type(b, jnp.uint16)))


def one_pass_triton(x, w):
    """The Triton form with K's chunk set past K (one pass): traced while the module's K_CHUNK is raised."""
    saved = triton_matmul.K_CHUNK
    triton_matmul.K_CHUNK = 1 << 30
    try:
        return triton_matmul.matmul(x, w)
    finally:
        triton_matmul.K_CHUNK = saved


def attempt(fn):
    try:
        return fn()
    except Exception as e:  # a config the kernel refuses: recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


if __name__ == "__main__":
    os.environ["JAX_OFFLOAD_HOPPER_MATMUL"] = "0"  # the chunked default: the engine's decode-size Triton form
    result = {"meta": run_metadata(), "configs": CONFIGS, "us": {}, "bits_equal_one_pass": {},
              "max_abs_diff_one_pass": {}}
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

    def jax_one_pass(tile_m: int, tile_n: int):
        cfg = hopper.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4, epi_tile_n=64,
                                  epi_tile_m=64, grid_minor_dim=hopper.MatmulDimension.N, grid_tile_width=8,
                                  wg_dimension=hopper.MatmulDimension.N)
        return lambda x, w: hopper.matmul(x, w, None, cfg)

    key = jax.random.PRNGKey(0)
    for name, (k, n) in SHAPES.items():
        all_ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
                  for i in range(LAYERS)]
        for m in ROWS + BATCH_ROWS:
            ws = all_ws[:4] if m > 512 else all_ws
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
            jax.clear_caches()  # the one-pass form traces with K_CHUNK raised: no trace of the chunked one reused
            one_pass = program(one_pass_triton)
            ref = jax.block_until_ready(one_pass(x, ws[:1])[0])
            times = {"cublas": per_matmul_us(program(jnp.dot), x, ws)}
            if m in ROWS:
                times["triton_one_pass"] = per_matmul_us(one_pass, x, ws)
                candidates = {f"gemv_t_n{tile_n}_s{steps}": functools.partial(gemv_t, tile_n=tile_n, steps=steps)
                              for tile_n, steps in CONFIGS}
            else:
                candidates = {f"jax_one_pass_{tm}x{tn}": jax_one_pass(tm, tn) for tm, tn in BATCH_TILES}
            jax.clear_caches()
            # The engine's chunked form: the Triton form at decode rows, the warpgroup form where `wgmma_suits` says.
            os.environ["JAX_OFFLOAD_HOPPER_MATMUL"] = "0" if m in ROWS else "1"
            times["chunked_engine"] = per_matmul_us(program(triton_matmul.matmul), x, ws)
            os.environ["JAX_OFFLOAD_HOPPER_MATMUL"] = "0"
            for label, fn in candidates.items():
                times[label] = attempt(lambda fn=fn: per_matmul_us(program(fn), x, ws))
                got = attempt(lambda fn=fn: jax.jit(fn)(x, ws[0]))
                if not isinstance(got, dict):
                    result["bits_equal_one_pass"][f"{name}.{m}.{label}"] = bool(same(got, ref))
                    result["max_abs_diff_one_pass"][f"{name}.{m}.{label}"] = float(
                        jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
            result["us"][f"{name}.{m}"] = times
            print(name, m, {lbl: round(t["median"], 1) if "median" in t else t["error"][:60] for lbl, t in times.items()},
                  flush=True)
            probe_output("probe_gemv_one_pass.json").write_text(json.dumps(result, indent=1))
        del all_ws
    print("bits equal to the one-pass Triton form:", result["bits_equal_one_pass"], flush=True)
