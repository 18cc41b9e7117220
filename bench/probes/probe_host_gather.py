"""Probe: how fast can Quest's chosen pages be gathered from pinned host memory and moved to the GPU?

One "pages" layer of the 8B shape at 128K (block 1024: [128, Hkv 8, 64 units, 2, 16, 128] bf16, 512 MiB) in
pinned host memory; 2048 random 8 KiB rows (budget 4096 tokens x 8 KV heads at page 16, 16 MiB). Times (median of
20 after warm-up, each call waited for): the store's gather (one host computation, one transfer), the gather split
into 2/4/8 host computations inside one jit (can XLA run them at once?), a contiguous 16 MiB transfer, and NumPy's
take of the same rows on 1 and 8 threads (what the host's memory allows). Prints JSON; writes
probe_host_gather.json under $OUT when set.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import call_seconds  # noqa: E402
from jax_offload.kv.host_store import _host_compute  # noqa: E402

gpu = jax.default_backend() == "gpu"
BLOCKS, HKV, UNITS, D = (128, 8, 64, 128) if gpu else (8, 2, 16, 32)
ROWS = 2048 if gpu else 64
dev = jax.devices()[0]
host = SingleDeviceSharding(dev, memory_kind="pinned_host")
device = SingleDeviceSharding(dev, memory_kind="device")
rng = np.random.default_rng(0)
layer_np = rng.standard_normal((BLOCKS, HKV, UNITS, 2, 16, D), np.float32).astype(jnp.bfloat16)
layer = jax.device_put(layer_np, host)
total_rows = BLOCKS * HKV * UNITS
rows_np = np.sort(rng.choice(total_rows, ROWS, replace=False)).astype(np.int32)
rows = jnp.asarray(rows_np)
out: dict = {"device": dev.device_kind, "jax": jax.__version__, "layer_MiB": layer.nbytes / 2**20,
             "gather_MiB": ROWS * 2 * 16 * D * 2 / 2**20}


def med(name, f, reps=20):
    ts = [t * 1e3 for t in call_seconds(f, reps)]
    out[name] = {"median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts))}
    print(name, out[name], flush=True)


def take(layer, rows):
    return layer.reshape(-1, 2, 16, D).at[rows].get(mode="promise_in_bounds")


@functools.partial(jax.jit, static_argnums=(2,))
def gather_split(layer, rows, parts):
    outs = []
    for r in jnp.split(rows, parts):
        outs.append(jax.device_put(_host_compute(take)(layer, jax.device_put(r, host)), device))
    return jnp.concatenate(outs)


for parts in (1, 2, 4, 8):
    med(f"gather_{parts}_host_computations", lambda: gather_split(layer, rows, parts))
    if parts == 1:
        ref = np.asarray(gather_split(layer, rows, 1).astype(jnp.float32))
        want = layer_np.reshape(-1, 2, 16, D)[rows_np].astype(np.float32)
        out["gather_equals_numpy"] = bool(np.array_equal(ref, want))

contiguous = jax.device_put(layer_np.reshape(-1, 2, 16, D)[:ROWS], host)
med("transfer_contiguous", lambda: jax.device_put(contiguous, device))

flat = layer_np.reshape(-1, 2 * 16 * D)
dst = np.empty((ROWS, flat.shape[1]), flat.dtype)


def numpy_take(threads):
    pieces = np.array_split(np.arange(ROWS), threads)

    def part(idx):
        np.take(flat, rows_np[idx], axis=0, out=dst[idx])

    if threads == 1:
        part(pieces[0])
    else:
        list(pool.map(part, pieces))
    return jnp.zeros(())


pool = ThreadPoolExecutor(8)
for threads in (1, 8):
    med(f"numpy_take_{threads}_threads", lambda: numpy_take(threads))

print(json.dumps(out))
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_host_gather.json").write_text(json.dumps(out, indent=1))
