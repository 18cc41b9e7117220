"""Probe: how the pinned-host KV store can be written in place and gathered page by page (Quest).

A. Writing a device block into an existing pinned-host buffer: does the buffer stay the same (pointer),
   and what does a write cost, against `device_put` into a fresh pinned buffer?
B. Gathering Quest's selected pages (8B shape: 8 KV heads, D 128, page 16, budget 4096 tokens per head)
   from a per-head page store of 128K tokens per layer, then moving them to the GPU:
   B0 one contiguous transfer of the same bytes (the floor);
   B1 a host-side gather under compute_on("device_host") per layer, then device_put;
   B2 a NumPy gather (threads) through a zero-copy view of the pinned buffers, then device_put.
Prints JSON lines; writes probe_host_kv.json under $OUT when set.
"""
from __future__ import annotations

import ctypes
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

dev = jax.devices()[0]
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
GPU = SingleDeviceSharding(dev, memory_kind="device")
out: dict = {"device": dev.device_kind, "jax": jax.__version__}


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


def host_view(x: jax.Array) -> np.ndarray:
    """A zero-copy uint16 NumPy view of a pinned-host bf16 array."""
    buf = (ctypes.c_uint16 * (x.nbytes // 2)).from_address(x.unsafe_buffer_pointer())
    return np.frombuffer(buf, np.uint16).reshape(x.shape)


# ---- A: in-place writes -------------------------------------------------------------------------
block_shape = (2, 4096, 8, 128)  # one 16 MiB block of the 8B shape
blk = jax.device_put(jnp.ones(block_shape, jnp.bfloat16), GPU)
variants = {
    "device_put_fresh": lambda old, new: jax.device_put(new, HOST),
    "jit_dus_donate": jax.jit(lambda old, new: jax.lax.dynamic_update_slice(old, new, (0, 0, 0, 0)),
                              donate_argnums=0, out_shardings=HOST),
    "jit_put_dus_donate": jax.jit(
        lambda old, new: jax.lax.dynamic_update_slice(old, jax.device_put(new, HOST), (0, 0, 0, 0)),
        donate_argnums=0, out_shardings=HOST),
}
try:
    from jax.experimental import compute_on as _co

    def _dus(old, new):
        return jax.lax.dynamic_update_slice(old, new, (0, 0, 0, 0))

    try:
        _host_dus = _co.compute_on(_dus, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    except TypeError:
        def _host_dus(old, new):
            with _co.compute_on("device_host"):
                return _dus(old, new)
    variants["compute_on_host_dus_donate"] = jax.jit(
        lambda old, new: _host_dus(old, jax.device_put(new, HOST)), donate_argnums=0, out_shardings=HOST)
except Exception as e:  # record why, keep going
    print(json.dumps({"compute_on_import": str(e)[:200]}))
for name, fn in variants.items():
    try:
        buf = jax.device_put(jnp.zeros(block_shape, jnp.bfloat16), HOST)
        ptrs = []
        ts = []
        for i in range(8):
            new = blk * jnp.bfloat16(i + 1)
            jax.block_until_ready(new)
            t = time.perf_counter()
            buf = fn(buf, new)
            jax.block_until_ready(buf)
            ts.append(time.perf_counter() - t)
            ptrs.append(buf.unsafe_buffer_pointer())
        ok = float(jax.device_put(buf, GPU)[0, 0, 0, 0]) == 8.0
        emit(f"A_{name}", {"same_pointer": len(set(ptrs)) == 1, "kind": buf.sharding.memory_kind,
                           "median_ms": float(np.median(ts[1:])) * 1e3, "GBps": buf.nbytes / np.median(ts[1:]) / 1e9,
                           "correct": ok})
    except Exception as e:  # record why, keep going
        emit(f"A_{name}", {"error": f"{type(e).__name__}: {str(e)[:300]}"})

x = jax.device_put(jnp.ones((1024,), jnp.bfloat16), HOST)
try:
    emit("np_asarray_zero_copy", int(np.asarray(x).__array_interface__["data"][0]) == x.unsafe_buffer_pointer())
except Exception as e:
    emit("np_asarray_zero_copy", f"{type(e).__name__}: {e}")

# ---- B: Quest page gather ------------------------------------------------------------------------
HKV, D, PAGE, CTX, BUDGET, LAYERS = 8, 128, 16, 131072, 4096, 4
n_pages, pick = CTX // PAGE, BUDGET // PAGE
page_elems = 2 * PAGE * D
stores = [jax.device_put(jax.random.normal(jax.random.PRNGKey(l), (HKV * n_pages, page_elems), jnp.bfloat16), HOST)
          for l in range(LAYERS)]
jax.block_until_ready(stores)
rng = np.random.default_rng(0)
sel = [np.concatenate([h * n_pages + np.sort(rng.choice(n_pages, pick, replace=False)) for h in range(HKV)]).astype(np.int32)
       for _ in range(LAYERS)]
nbytes = HKV * pick * page_elems * 2
emit("B_bytes_per_layer", nbytes)
contig = jax.device_put(jnp.zeros((HKV * pick, page_elems), jnp.bfloat16), HOST)
emit("B0_contiguous_per_layer", med(lambda: jax.block_until_ready(jax.device_put(contig, GPU))))

try:
    from jax.experimental import compute_on as co

    def take(s, i):
        return s.at[i].get(mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)

    try:
        host_take = co.compute_on(take, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    except TypeError:
        def host_take(s, i):
            with co.compute_on("device_host"):
                return take(s, i)
    gather = jax.jit(host_take)
    idx_h = [jax.device_put(jnp.asarray(s), HOST) for s in sel]

    def b1_serial():
        for l in range(LAYERS):
            jax.block_until_ready(jax.device_put(gather(stores[l], idx_h[l]), GPU))

    def b1_async():
        jax.block_until_ready([jax.device_put(gather(stores[l], idx_h[l]), GPU) for l in range(LAYERS)])

    g = jax.device_put(gather(stores[0], idx_h[0]), GPU)
    ref = jax.device_put(stores[0], GPU)[jnp.asarray(sel[0])]
    emit("B1_correct", bool(jnp.array_equal(g, ref)))
    emit("B1_gather_only_per_layer", med(lambda: jax.block_until_ready(gather(stores[0], idx_h[0]))))
    emit("B1_serial_all_layers", med(b1_serial))
    emit("B1_async_all_layers", med(b1_async))
except Exception as e:
    emit("B1_error", f"{type(e).__name__}: {str(e)[:300]}")

try:
    views = [host_view(s) for s in stores]
    outs = [jax.device_put(jnp.zeros((HKV * pick, page_elems), jnp.bfloat16), HOST) for _ in range(LAYERS)]
    jax.block_until_ready(outs)
    out_views = [host_view(o) for o in outs]
    for threads in (1, 4, 8, 16):
        pool = ThreadPoolExecutor(threads)

        def np_gather(l):
            parts = np.array_split(np.arange(len(sel[l])), threads)
            list(pool.map(lambda p: np.take(views[l], sel[l][p], axis=0, out=out_views[l][p[0]:p[-1] + 1]), parts))

        def b2_serial():
            moved = []
            for l in range(LAYERS):
                np_gather(l)
                moved.append(jax.device_put(outs[l], GPU))
            jax.block_until_ready(moved)

        emit(f"B2_threads{threads}_gather_only_per_layer", med(lambda: np_gather(0)))
        emit(f"B2_threads{threads}_gather_then_put_all_layers", med(b2_serial))
        np_gather(0)
        g2 = jax.device_put(outs[0], GPU)
        emit(f"B2_threads{threads}_correct",
             bool(jnp.array_equal(g2, jax.device_put(stores[0], GPU)[jnp.asarray(sel[0])])))
        pool.shutdown()
except Exception as e:
    emit("B2_error", f"{type(e).__name__}: {str(e)[:300]}")

# ---- C: compile option ---------------------------------------------------------------------------
try:
    f = jax.jit(lambda a: (a * 1.37 + 0.3) * a, compiler_options={"xla_allow_excess_precision": False})
    f(jnp.ones((8,), jnp.bfloat16)).block_until_ready()
    emit("C_strict_precision_option", "accepted")
except Exception as e:
    emit("C_strict_precision_option", f"{type(e).__name__}: {str(e)[:200]}")

if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "probe_host_kv.json"), "w") as fh:
        json.dump(out, fh, indent=1)
