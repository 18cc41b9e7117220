"""Probe: can a GPU kernel read Quest's chosen pages straight out of pinned host memory (zero copy)?

The store's gather runs on the host and costs ~1.3 ms per layer for 16 MiB (probe_host_gather), the floor of
Quest decode as built. If a kernel could read the pinned pages itself, each layer would cost only the bytes over
PCIe. Same shapes as probe_host_gather: a 512 MiB layer of 8 KiB rows in pinned host memory, 2048 random rows.
Tries, each timed (median of 20 after warm-up, each call waited for) or reported with the error it raised:
  pallas_device   a Pallas kernel gathering the rows of a device-memory copy (reference speed)
  pallas_host     the same kernel given the pinned_host array inside jit
  xla_host        `layer[rows]` on the pinned_host array inside jit (no compute_on)
and, for the two host variants, whether the compiled program copies the whole layer to the device (its HLO
holds a copy of the layer's size). Prints JSON; writes probe_pinned_pallas.json under $OUT when set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import call_seconds, run_metadata  # noqa: E402

gpu = jax.default_backend() == "gpu"
TOTAL_ROWS, ROW, ROWS = (65536, 4096, 2048) if gpu else (256, 64, 16)  # a row: 16 tokens of K or V, D 128, bf16
dev = jax.devices()[0]
kinds = {m.kind for m in dev.addressable_memories()}
host = SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else "unpinned_host")
device = SingleDeviceSharding(dev, memory_kind="device")
rng = np.random.default_rng(0)
layer_np = rng.standard_normal((TOTAL_ROWS, ROW), np.float32).astype(jnp.bfloat16)
rows_np = np.sort(rng.choice(TOTAL_ROWS, ROWS, replace=False)).astype(np.int32)
rows = jnp.asarray(rows_np)
expected = layer_np[rows_np]
out: dict = run_metadata() | {"layer_MiB": layer_np.nbytes / 2**20,
             "gather_MiB": expected.nbytes / 2**20, "host_memory_kind": host.memory_kind}


def gather_kernel(rows_ref, layer_ref, o_ref):
    o_ref[...] = layer_ref[pl.ds(rows_ref[pl.program_id(0)], 1), :]


def pallas_gather(layer, rows):
    return pl.pallas_call(
        gather_kernel, grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec(rows.shape, lambda i: (0,)), pl.BlockSpec(layer.shape, lambda i: (0, 0))],
        out_specs=pl.BlockSpec((1, layer.shape[1]), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], layer.shape[1]), layer.dtype),
        interpret=not gpu)(rows, layer)


def xla_gather(layer, rows):
    return layer[rows]


def attempt(name, fn, layer):
    try:
        step = jax.jit(fn)
        hlo = step.lower(layer, rows).compile().as_text()
        got = np.asarray(step(layer, rows))
        ts = [t * 1e3 for t in call_seconds(lambda: step(layer, rows), 20)]
        out[name] = {"median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts)),
                     "correct": bool(np.array_equal(got.astype(np.float32), expected.astype(np.float32))),
                     "copies_whole_layer": any(f"bf16[{TOTAL_ROWS},{ROW}]" in line
                                               and (" copy(" in line or "copy-start(" in line)
                                               for line in hlo.splitlines()),
                     "hlo_ops": sorted({w for w in ("copy-start", "copy-done", "custom-call", "dynamic-slice",
                                                    "gather", "S(5)") if w in hlo})}
    except Exception as e:  # noqa: BLE001 - the probe reports what each attempt raised
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(name, out[name], flush=True)


attempt("pallas_device", pallas_gather, jax.device_put(layer_np, device))
layer_host = jax.device_put(layer_np, host)
attempt("pallas_host", pallas_gather, layer_host)
attempt("xla_host", xla_gather, layer_host)
text = json.dumps(out, indent=1)
print(text)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_pinned_pallas.json").write_text(text + "\n")
