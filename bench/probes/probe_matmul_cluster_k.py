"""Probe: can a pair of CTAs split K by chunks and keep the batch-invariant matmul's bits, so that the 8B's decode
matmuls at 128-256 rows fill the H200's SMs (issue 64)?

The chunked order (pallas_kernels/matmul.py) adds each 1,024-key chunk's float32 sum to a running total in chunk
order, so the chunks' sums need not be computed in order: here CTA 1 of a cluster of two sums the odd chunks, CTA 0
the even ones, and CTA 1 hands each chunk's sum to CTA 0 through distributed shared memory (`async_store_smem`, an
st.async into CTA 0's shared memory completing on CTA 0's barrier); CTA 0 adds its chunk, then CTA 1's, and tells CTA
1 the buffer is free (a cluster barrier). The same additions in the same order: the bits of `matmul.matmul`. Twice
the CTAs of the library's form (pallas_kernels/mgpu_matmul.py) for the same tiles: at 256 rows w_down gets 128 CTAs
of 128 x 128 (the library: 128 CTAs of 64 x 128, which run at ~47% of the bf16 peak, or 64 of 128 x 128), w_gate_up
896 CTAs of 128 x 128 over half of K (6.8 waves of 132 SMs, against 3.4 waves of 448).

On a GPU, per shape and row count: bits against the Triton form and the library's warpgroup form, and us a matmul
(16 distinct weights a program, median of 7 loops of 10 programs, min-max) of cuBLAS on [B, K] and on the engine's
[B, 1, K] rows, the Triton form, the library's warpgroup form at its default tiles and this one. On a CPU it only
lowers the kernel for CUDA (the Mosaic interpreter runs no cluster barrier).

    timeout 300 python -u bench/probes/probe_matmul_cluster_k.py --out $OUT/cluster_k.json
    timeout 45 python -u bench/probes/probe_matmul_cluster_k.py --shapes w_down --rows 128 --stage bits
    python bench/probes/probe_matmul_cluster_k.py --lower-only     # a CPU: lowering for CUDA only

Run it under `timeout` and `python -u`: a hand-off barrier whose count is wrong hangs the kernel rather than failing.
On the H200 with jax 0.11.2 a count of 128 (one per thread of the sending warpgroup, as the lowering's per-thread
`arrive_expect_tx` reads) hung, and 1 gave the Triton form's bits; `--stage`, `--no-handoff` and `--handoff-arrivals`
are that diagnosis (`bench/results/runs/h200_invariant_price/price_2026_12_01/cluster_k/`). The results are written
after each shape.
"""
import argparse
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ["JAX_OFFLOAD_HOPPER_MATMUL"] = "0"  # `matmul` below is the Triton form: the reference bits

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from common import attempt, matmul_ms, run_metadata  # noqa: E402
from pallas_kernels.matmul import BLOCK_K, chunk_len_for, matmul  # noqa: E402
from pallas_kernels.mgpu_matmul import (_COMPUTE_WGS as WGS, _EPILOGUE as EPILOGUE, GROUP_M, _swizzled,  # noqa: E402
                                        default_tiles, mgpu_matmul, store_tile)

SHAPES = {"w_down": (14336, 4096), "w_gate_up": (4096, 28672), "wqkv": (4096, 6144), "wo": (4096, 4096)}
ROWS = (128, 256)
CONFIGS = {  # (tile_m, tile_n of each consumer warpgroup, split_rows, ring slots)
    "pair_rows_64x128_s4": (64, 128, True, 4),   # CTA 128 x 128
    "pair_cols_64x64_s4": (64, 64, False, 4),    # CTA 64 x 128
}


def _kernel(x_gmem, w_gmem, o_gmem, o_smem, recv, recv_full, consumed, *, tile_m, tile_n, split_rows, steps,
            m_tiles, n_tiles, handoff):
    k = x_gmem.shape[1]
    tpc = chunk_len_for(k, False) // BLOCK_K  # k-tiles a chunk
    tile = lax.axis_index("tile")
    group = tile // (GROUP_M * n_tiles)
    first_m = group * GROUP_M
    group_rows = jnp.minimum(m_tiles - first_m, GROUP_M)
    in_group = tile % (GROUP_M * n_tiles)
    m_idx, n_idx = first_m + in_group % group_rows, in_group // group_rows
    cta_m, cta_n = (WGS * tile_m, tile_n) if split_rows else (tile_m, WGS * tile_n)
    cta_rows, cta_cols = pl.ds(m_idx * cta_m, cta_m), pl.ds(n_idx * cta_n, cta_n)
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(wg * tile_m, tile_m) if split_rows else slice(None)
    wg_cols = slice(None) if split_rows else pl.ds(wg * tile_n, tile_n)
    cta = lax.axis_index("kpair")

    def k_tile(t):
        # This CTA's t-th k-tile: chunk 2 * (t // tpc) + cta, tile t % tpc of it.
        return (2 * (t // tpc) + lax.axis_index("kpair")) * tpc + t % tpc

    def filled(value: float):
        return plgpu.layout_cast(jnp.full((tile_m, tile_n), value, jnp.float32), plgpu.Layout.WGMMA)

    def add_tile(part, x_smem, w_smem):
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.at[:, wg_cols])

        return pl.run_state(mma)(plgpu.ACC.init(part))

    # `consumed` (a barrier of the pair) completes a phase when both CTAs have arrived: each CTA waits for phase c at
    # its c-th chunk's end and arrives for phase c + 1 after it, so CTA 1 writes a chunk's sum only once CTA 0 has
    # read the last one, and neither CTA leaves while the other may still reach its shared memory.
    def even_chunk(part, total):  # CTA 0: its chunk, then CTA 1's, in chunk order
        total = total + part
        if not handoff:
            return filled(0.0), total
        plgpu.barrier_wait(recv_full.at[wg])
        return filled(0.0), total + recv[wg]

    def odd_chunk(part, total):  # CTA 1: hands its chunk's sum to CTA 0
        if handoff:
            plgpu.async_store_smem(part, recv.at[wg], recv_full.at[wg], cluster_idx=0, cluster_dim="kpair")
        return filled(0.0), total

    def chunk_end(part, total):
        plgpu.barrier_wait(consumed.at[wg])
        part, total = lax.cond(cta == 0, even_chunk, odd_chunk, part, total)
        plgpu.barrier_arrive(consumed.at[wg])
        return part, total

    def step(idxs, x_smem, w_smem, carry):
        (t,) = idxs
        part, total = carry
        part = add_tile(part, x_smem, w_smem)
        return lax.cond((t + 1) % tpc == 0, chunk_end, lambda p, s: (p, s), part, total)

    def compute(run_pipeline):
        plgpu.barrier_arrive(consumed.at[wg])  # phase 0: the buffer starts free
        _, total = run_pipeline((filled(0.0), filled(-0.0)))
        plgpu.barrier_wait(consumed.at[wg])  # the last phase: both CTAs are done with each other

        @pl.when(cta == 0)
        def _():
            store_tile(total.astype(o_gmem.dtype), o_smem.at[wg], o_gmem.at[cta_rows, cta_cols].at[wg_rows, wg_cols])

    pipeline = plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(k // BLOCK_K // 2,),
        memory_registers=40,
        in_specs=[plgpu.BlockSpec((cta_m, BLOCK_K), lambda t: (0, k_tile(t)), transforms=_swizzled(BLOCK_K)),
                  plgpu.BlockSpec((BLOCK_K, cta_n), lambda t: (k_tile(t), 0), transforms=_swizzled(BLOCK_K))],
        wg_axis="wg",
        num_compute_wgs=WGS,
        max_concurrent_steps=steps,
        compute_context=compute,
    )
    pipeline(x_gmem.at[cta_rows, :], w_gmem.at[:, cta_cols])


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n", "split_rows", "steps", "handoff",
                                             "handoff_arrivals"))
def cluster_k_matmul(x, w, *, tile_m, tile_n, split_rows, steps, handoff=True, handoff_arrivals=1):
    """x [M, K] @ w [K, N] in bf16 with `matmul`'s chunked order, K split by chunks over a CTA pair (an even number
    of whole 1,024-key chunks). `handoff=False` (a hang's diagnosis) drops the odd chunks: wrong sums, the same
    cluster barriers."""
    m, k = x.shape
    n = w.shape[1]
    if k % chunk_len_for(k, False) or (k // chunk_len_for(k, False)) % 2:
        raise ValueError(f"K={k}: allowed, an even number of whole chunks")
    cta_m, cta_n = (WGS * tile_m, tile_n) if split_rows else (tile_m, WGS * tile_n)
    m_pad = -(-m // cta_m) * cta_m
    if m_pad != m:
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    m_tiles, n_tiles = m_pad // cta_m, n // cta_n
    out = plgpu.kernel(
        functools.partial(_kernel, tile_m=tile_m, tile_n=tile_n, split_rows=split_rows, steps=steps,
                          m_tiles=m_tiles, n_tiles=n_tiles, handoff=handoff),
        out_type=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        scratch_types=(plgpu.SMEM((WGS, 2, EPILOGUE, EPILOGUE), x.dtype, transforms=_swizzled(64)),
                       plgpu.SMEM((WGS, tile_m, tile_n), jnp.float32, transforms=_swizzled(32)),
                       # a hand-off: the count jax 0.11.2 completes with on the H200 (see the docstring)
                       plgpu.Barrier(num_arrivals=handoff_arrivals, num_barriers=WGS),
                       plgpu.ClusterBarrier(collective_axes=("kpair",), num_arrivals=1, num_barriers=WGS)),
        grid=(m_tiles * n_tiles,),
        grid_names=("tile",),
        cluster=(2,),
        cluster_names=("kpair",),
        num_threads=WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, w)
    return out[:m]


def _diagnose(a, configs) -> None:
    for sname in a.shapes.split(","):
        k, n = SHAPES[sname]
        w = (jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        for m in map(int, a.rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
            for name, (tm, tn, split_rows, steps) in configs.items():
                fn = jax.jit(functools.partial(cluster_k_matmul, tile_m=tm, tile_n=tn, split_rows=split_rows,
                                               steps=steps, handoff=a.handoff,
                                               handoff_arrivals=a.handoff_arrivals))
                print(sname, m, name, "handoff" if a.handoff else "no handoff", "compiling", flush=True)
                compiled = fn.lower(x, w).compile()
                print("  compiled", flush=True)
                if a.stage == "bits":
                    got = compiled(x, w).block_until_ready()
                    ref = jax.jit(matmul)(x, w)
                    print("  ran; bits equal:", bool(jnp.array_equal(got, ref)), "max abs diff:",
                          float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32)))), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--lower-only", action="store_true", help="lower each config for CUDA and stop (a CPU check)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--stage", choices=("compile", "bits"),
                   help="a hang's diagnosis: only compile, or only run once against the reference, each config")
    p.add_argument("--no-handoff", dest="handoff", action="store_false", help="drop the hand-off (diagnosis only)")
    p.add_argument("--handoff-arrivals", type=int, default=1, help="the hand-off barrier's count (diagnosis only)")
    a = p.parse_args()
    configs = {name: CONFIGS[name] for name in a.configs.split(",")}
    if a.stage:
        _diagnose(a, configs)
        return
    if a.lower_only:
        for name, (tm, tn, split_rows, steps) in configs.items():
            x = jax.ShapeDtypeStruct((256, 14336), jnp.bfloat16)
            w = jax.ShapeDtypeStruct((14336, 4096), jnp.bfloat16)
            fn = functools.partial(cluster_k_matmul, tile_m=tm, tile_n=tn, split_rows=split_rows, steps=steps)
            jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))
            print(name, "lowers for CUDA", flush=True)
        return
    result = {"meta": run_metadata(), "rows": []}
    key = jax.random.PRNGKey(0)
    for sname in a.shapes.split(","):
        k, n = SHAPES[sname]
        ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
              for i in range(16)]
        for m in map(int, a.rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
            refs = [jax.jit(matmul)(x, w) for w in ws]
            ref = refs[0]
            row = {"shape": sname, "k": k, "n": n, "rows": m,
                   "cublas": matmul_ms(jnp.dot, x, ws),
                   "cublas_engine_rows": matmul_ms(lambda x, w: (x[:, None, :] @ w)[:, 0], x, ws),
                   "triton_form": matmul_ms(matmul, x, ws)}
            library = functools.partial(mgpu_matmul, **default_tiles(m, n))
            row["library"] = {**matmul_ms(library, x, ws), "tiles": default_tiles(m, n),
                              "bits_equal_triton": bool(jnp.array_equal(jax.jit(library)(x, ws[0]), ref))}
            for name, (tm, tn, split_rows, steps) in configs.items():
                fn = functools.partial(cluster_k_matmul, tile_m=tm, tile_n=tn, split_rows=split_rows, steps=steps)

                def run(fn=fn):
                    # every weight: a hand-off that raced would show as a difference in some of them
                    got = [jax.jit(fn)(x, w) for w in ws]
                    bits = all(bool(jnp.array_equal(g, r)) for g, r in zip(got, refs))
                    diff = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
                               for g, r in zip(got, refs))
                    return {**matmul_ms(fn, x, ws), "bits_equal_triton": bits, "max_abs_diff": diff}

                row[name] = attempt(run)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
