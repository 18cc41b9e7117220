"""Does reading blocks out of one pinned buffer overlap GPU compute, and which way of reading does?

`bench/results/runs/h200_sketch_prefill/`: a sketch request's chunked prefill is ~1.8x a full-policy one, and
`probe_store_rw.py` showed (H100) that a one-buffer ("pages") layer's block write and read cost what a "blocks"
layer's do when each is waited on. What differs is how they run: a "blocks" layer's group is one `device_put` of
separate pinned arrays (a copy the runtime issues apart from the programs), a "pages" layer's group is a jitted
program slicing the pinned layer (`HostKVStore._read_consecutive`), which runs in order with the compute programs.

Times, per group of `--group` blocks, ms (median, min-max of `--repeats` rounds):
  compute      a chain of matmuls standing for a group's attention, alone
  read_blocks  `device_put` of the group's separate pinned blocks, alone
  read_slice   `_read_consecutive`'s program, alone
  blocks+comp  compute and the next group's `device_put`, dispatched together (the full policy's ring)
  slice+comp   compute and the next group's slice program, dispatched together (the pages ring today)
  fused        one program doing compute and the next group's slice (an in-program copy XLA may overlap)
  fused_stream the same with the slice on a second GPU stream (`compute_on(..., compute_type="gpu_stream:1")`;
               XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true may be needed)
Overlap shows as a pair costing about the larger of its parts rather than their sum.

    mkdir -p $OUT/pinned_overlap; python bench/probes/probe_pinned_overlap.py --out $OUT/pinned_overlap 2> $OUT/pinned_overlap/stderr.txt
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import run_metadata, stats  # noqa: E402

HKV, D, UNIT = 8, 128, 16


@functools.partial(jax.jit, static_argnums=(1,))
def compute(x: jax.Array, steps: int) -> jax.Array:
    for _ in range(steps):
        x = jnp.tanh(x @ x) * 0.5
    return x


@functools.partial(jax.jit, static_argnums=(2, 3))
def read_slice(layer: jax.Array, first: jax.Array, count: int, device) -> jax.Array:
    return jax.device_put(jax.lax.dynamic_slice_in_dim(layer, first, count), device)


@functools.partial(jax.jit, static_argnums=(3, 4))
def fused(x: jax.Array, layer: jax.Array, first: jax.Array, count: int, steps: int):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    return compute(x, steps), jax.device_put(jax.lax.dynamic_slice_in_dim(layer, first, count), device)


@functools.partial(jax.jit, static_argnums=(3, 4))
def fused_stream(x: jax.Array, layer: jax.Array, first: jax.Array, count: int, steps: int):
    from jax.experimental import compute_on

    on_stream = getattr(compute_on, "compute_on2", compute_on.compute_on)  # jax 0.10 / 0.11
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    read = on_stream(lambda layer, first: jax.device_put(jax.lax.dynamic_slice_in_dim(layer, first, count), device),
                       compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)
    return compute(x, steps), read(layer, first)


def timed(fn, repeats: int, inner: int) -> dict:
    jax.block_until_ready(fn())
    rounds = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t) * 1e3 / inner)
    return stats(rounds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=32, help="blocks in the pinned layer")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--n", type=int, default=4096, help="matmul size of the stand-in compute")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=4, help="groups per round")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    block_shape = (HKV, a.block_size // UNIT, 2, UNIT, D)
    rng = np.random.default_rng(0)
    host_block = rng.standard_normal(block_shape, np.float32).astype(jnp.bfloat16)
    blocks = [jax.device_put(host_block, pinned) for _ in range(a.blocks)]
    layer = jax.device_put(np.broadcast_to(host_block, (a.blocks, *block_shape)), pinned)
    x = jax.device_put((rng.standard_normal((a.n, a.n), np.float32) * 0.01).astype(jnp.bfloat16), device)
    first = jax.device_put(np.int32(a.group), device)
    g = a.group

    def read_blocks():
        return jax.device_put(blocks[g : 2 * g], device)

    rows = {
        "compute": timed(lambda: compute(x, a.steps), a.repeats, a.inner),
        "read_blocks": timed(read_blocks, a.repeats, a.inner),
        "read_slice": timed(lambda: read_slice(layer, first, g, device), a.repeats, a.inner),
        "blocks+comp": timed(lambda: (read_blocks(), compute(x, a.steps)), a.repeats, a.inner),
        "slice+comp": timed(lambda: (read_slice(layer, first, g, device), compute(x, a.steps)), a.repeats, a.inner),
        "fused": timed(lambda: fused(x, layer, first, g, a.steps), a.repeats, a.inner),
    }
    try:
        rows["fused_stream"] = timed(lambda: fused_stream(x, layer, first, g, a.steps), a.repeats, a.inner)
        (a.out / "fused_stream.hlo.txt").write_text(fused_stream.lower(x, layer, first, g, a.steps).compile().as_text())
    except Exception as e:  # noqa: BLE001 - the probe records what this jax cannot do
        rows["fused_stream"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    group_bytes = g * int(np.prod(block_shape)) * 2
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:12s} {row['error'][:300]}", flush=True)
        else:
            print(f"{name:12s} {row['median']:8.2f} ms ({row['min']:.2f}-{row['max']:.2f})", flush=True)
    hlo = fused.lower(x, layer, first, g, a.steps).compile().as_text()
    (a.out / "fused.hlo.txt").write_text(hlo)
    (a.out / "probe_pinned_overlap.json").write_text(json.dumps(
        {"meta": run_metadata(), "args": {k: str(v) for k, v in vars(a).items()}, "group_bytes": group_bytes,
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
