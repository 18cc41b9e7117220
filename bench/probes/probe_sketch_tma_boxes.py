"""Probe: how fast can TMA bring an int4 sketch into shared memory, by box shape? The sketch kernel
(pallas_kernels/mgpu_sketch.py) reads at ~1.3-1.4x the time XLA takes to read the same bytes, and an earlier run
found its loads alone near that (`bench/results/runs/h100_sketch_mgpu/tries/`). Its boxes are [64 pages, 64 B]: a
64-byte inner dimension. Here kernels that only load (a CTA per 64 pages and KV head, as the sketch kernel: 16
offsets' tiles, 64 KiB, then a 2 KiB write) with other boxes over the same bytes:
  rows64: 16 boxes [64, 64 B], 64-byte swizzle (today's kernel);
  rows64_flat: the same without swizzle;
  rows128: 16 boxes [32, 128 B] (the same 4 KiB of each offset seen as 128-byte rows), 128-byte swizzle;
  one_box128: one 3D box [16, 32, 128 B] a CTA;
  one_box64: one 3D box [16, 64, 64 B] a CTA.
Llama-3.1-8B shape (8 KV heads, head dim 128, page 16), 30 layers of 256K tokens; GPU ms per pass over the 30 layers
as probe_sketch_mgpu.py measures it ((t4 - t1) / 3, medians of 20 waited calls), 3 alternated rounds, with XLA's
chained read of the same bytes.

    python bench/probes/probe_sketch_tma_boxes.py --out DIR    # on the GPU: DIR/probe_sketch_tma_boxes.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from common import run_metadata  # noqa: E402
from probe_sketch_mgpu import REPEATS, gpu_ms_per_pass, xla_chained_reads  # noqa: E402

HKV, D, PAGE, LAYERS, ROUNDS, PAGES_PER_CTA = 8, 128, 16, 30, 3, 64


def smem(shape, swizzle):
    if swizzle is None:
        return plgpu.SMEM(shape, jnp.uint8)
    return plgpu.SMEM(shape, jnp.uint8, transforms=(plgpu.TilingTransform((8, swizzle)),
                                                     plgpu.SwizzleTransform(swizzle)))


def loader(variant: str, pages: int):
    row = 128 if variant in ("rows128", "one_box128") else 64
    rows = PAGES_PER_CTA * 64 // row
    swizzle = None if variant == "rows64_flat" else row
    one_box = variant.startswith("one_box")
    blocks = pages // PAGES_PER_CTA

    def kernel(codes_ref, salt_ref, out_ref, tiles, out_smem, ready):  # salt: passes differ, so none is merged
        block = lax.axis_index("pages")
        head = lax.axis_index("heads")
        span = pl.ds(block * rows, rows)
        if one_box:
            plgpu.copy_gmem_to_smem(codes_ref.at[head, :, span], tiles, ready.at[0])
            plgpu.barrier_wait(ready.at[0])
        else:
            for o in range(PAGE):
                plgpu.copy_gmem_to_smem(codes_ref.at[head, o, span], tiles.at[o], ready.at[o])
            for o in range(PAGE):
                plgpu.barrier_wait(ready.at[o])
        out_smem[...] = plgpu.layout_cast(jnp.zeros((PAGES_PER_CTA, 8), jnp.float32), plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[head, pl.ds(block * PAGES_PER_CTA, PAGES_PER_CTA)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((HKV, pages, 8), jnp.float32),
        scratch_types=(smem((PAGE, rows, row), swizzle), plgpu.SMEM((PAGES_PER_CTA, 8), jnp.float32),
                       plgpu.Barrier(num_barriers=PAGE)),
        grid=(blocks, HKV), grid_names=("pages", "heads"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    return lambda codes, salt: call(codes.reshape(HKV, PAGE, pages * 64 // row, row), salt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=262144)
    args = ap.parse_args()
    pages = args.tokens // PAGE
    keys = jax.random.split(jax.random.PRNGKey(0), LAYERS)
    codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys]
    variants = ("rows64", "rows64_flat", "rows128", "one_box128", "one_box64")
    runs, errors = {}, {}
    for v in variants:
        try:
            f = loader(v, pages)
            for r in (1, REPEATS):
                passes = jax.jit(lambda c, f=f, r=r: [f(c[i], jnp.full((8,), j, jnp.int32))
                                                      for j in range(r) for i in range(LAYERS)])
                runs[v, r] = passes.lower(codes).compile()
        except Exception as e:  # noqa: BLE001
            errors[v] = str(e).splitlines()[0][:300]
            print(v, "failed:", errors[v], flush=True)

    for r in (1, REPEATS):
        runs["xla_read", r] = jax.jit(lambda c, r=r: xla_chained_reads(c, None, r)).lower(codes).compile()
    names = [v for v in variants if v not in errors] + ["xla_read"]
    per_pass = gpu_ms_per_pass(runs, names, (codes,), ROUNDS)
    result = {**run_metadata(), "tokens": args.tokens, "bytes_per_pass": sum(c.nbytes for c in codes),
              "gpu_ms_per_pass_of_30_layers_per_round": per_pass, "errors": errors}
    path = Path(args.out, "probe_sketch_tma_boxes.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
