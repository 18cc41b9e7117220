"""Probe: one pinned-host array per layer as the KV store ([blocks, Hkv, units, 2, 16, D], 8B shape, 128K).

P1 write a 16 MiB device block into block b in place (donated dynamic_update_slice): pointer and time;
P2 read n consecutive blocks to the GPU with a jitted dynamic_slice: time against a standalone block put;
P3 gather Quest pages (budget 4096 tokens/head, page 16) from the layer array on the host (compute_on),
   then to the GPU; and the same split in two halves issued back to back.
Prints JSON lines; writes probe_layer_store.json under $OUT when set.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding

dev = jax.devices()[0]
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
GPU = SingleDeviceSharding(dev, memory_kind="device")
out: dict = {"device": dev.device_kind, "jax": jax.__version__}
NB, HKV, BS, D = (32, 8, 4096, 128) if jax.default_backend() == "gpu" else (4, 2, 256, 64)
UNITS = BS // 16
shape = (NB, HKV, UNITS, 2, 16, D)


def med(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return {"median_ms": float(np.median(ts)) * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3}


def emit(key, value):
    out[key] = value
    print(json.dumps({key: value}), flush=True)


store = jax.device_put(jnp.zeros(shape, jnp.bfloat16), HOST)
jax.block_until_ready(store)
ptr0 = store.unsafe_buffer_pointer()
try:
    write = jax.jit(lambda s, blk, b: lax.dynamic_update_slice(s, jax.device_put(blk, HOST)[None], (b, 0, 0, 0, 0, 0)),
                    donate_argnums=0)
    blk = jax.random.normal(jax.random.PRNGKey(0), shape[1:], jnp.bfloat16)
    ts = []
    for i in range(NB):
        jax.block_until_ready(blk)
        t = time.perf_counter()
        store = write(store, blk + jnp.bfloat16(i), jnp.int32(i))
        jax.block_until_ready(store)
        ts.append(time.perf_counter() - t)
    emit("P1_write", {"same_pointer": store.unsafe_buffer_pointer() == ptr0, "kind": store.sharding.memory_kind,
                      "median_ms": float(np.median(ts[2:])) * 1e3, "max_ms": max(ts[2:]) * 1e3,
                      "GBps": blk.nbytes / np.median(ts[2:]) / 1e9})
    check = jax.device_put(store, GPU)
    emit("P1_correct", bool(jnp.array_equal(check[NB - 1], blk + jnp.bfloat16(NB - 1))))
    del check
except Exception as e:
    emit("P1_error", f"{type(e).__name__}: {str(e)[:400]}")

for n in (1, 2, 4):
    try:
        read = jax.jit(lambda s, b: jax.device_put(lax.dynamic_slice(s, (b, 0, 0, 0, 0, 0), (n,) + shape[1:]), GPU))
        start = min(3, NB - n)
        r = read(store, jnp.int32(start))
        ok = bool(jnp.array_equal(r, jax.device_put(store, GPU)[start:start + n]))
        emit(f"P2_read{n}", {**med(lambda: jax.block_until_ready(read(store, jnp.int32(7)))), "correct": ok,
                             "GBps_at_median": n * blk.nbytes / (med(lambda: jax.block_until_ready(read(store, jnp.int32(9))))["median_ms"] / 1e3) / 1e9})
    except Exception as e:
        emit(f"P2_read{n}_error", f"{type(e).__name__}: {str(e)[:400]}")
standalone = [jax.device_put(jnp.ones(shape[1:], jnp.bfloat16), HOST) for _ in range(2)]
emit("P2_standalone_put2", med(lambda: jax.block_until_ready(jax.device_put(standalone, GPU))))

try:
    from jax.experimental import compute_on as co

    def take(s, i):
        flat = s.reshape(NB * HKV * UNITS, 2 * 16 * D)
        return flat.at[i].get(mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)

    try:
        host_take = co.compute_on(take, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    except TypeError:
        def host_take(s, i):
            with co.compute_on("device_host"):
                return take(s, i)
    gather = jax.jit(lambda s, i: jax.device_put(host_take(s, jax.device_put(i, HOST)), GPU))
    rng = np.random.default_rng(0)
    pick = min(4096, NB * BS // 2) // 16
    # per head: 256 pages among all blocks' units of that head; flat row = (block * HKV + head) * UNITS + unit
    sel = []
    for h in range(HKV):
        pages = np.sort(rng.choice(NB * UNITS, pick, replace=False))
        sel.append((pages // UNITS * HKV + h) * UNITS + pages % UNITS)
    idx = jnp.asarray(np.sort(np.concatenate(sel)).astype(np.int32))
    idx_dev = jax.device_put(idx, GPU)
    g = gather(store, idx_dev)
    ref = jax.device_put(store, GPU).reshape(NB * HKV * UNITS, -1)[idx]
    emit("P3_correct", bool(jnp.array_equal(g, ref)))
    del ref
    emit("P3_gather_put_idx_on_gpu", med(lambda: jax.block_until_ready(gather(store, idx_dev))))
    idx_host = jax.device_put(idx, HOST)
    emit("P3_gather_put_idx_on_host", med(lambda: jax.block_until_ready(gather(store, idx_host))))
    halves = [idx_dev[: len(idx) // 2], idx_dev[len(idx) // 2:]]
    emit("P3_two_halves", med(lambda: jax.block_until_ready([gather(store, h) for h in halves])))
except Exception as e:
    emit("P3_error", f"{type(e).__name__}: {str(e)[:400]}")

if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "probe_layer_store.json"), "w") as fh:
        json.dump(out, fh, indent=1)
