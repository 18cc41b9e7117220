"""Probe: the two costs of a Quest decode layer that are not the model's, at the 8B shape and 128K context.

1. Choosing pages (bounds of q against each page's min/max keys, then the top pages of every KV head). The
   engine's choice took ~2 ms per layer on the H100 (bench/results/sparse.md). Variants, each one jitted call
   on q [32, 128] and bounds [8, P, 128] bf16, P pages of 16 (8192 at 128K, 16384 at 256K):
     broadcast_topk  the engine's: the bound by broadcasting q against min and max, then lax.top_k
     einsum_topk     the bound as two matmuls, relu(q) @ max + min(q, 0) @ min (the same products), top_k
     einsum_sort     the bound as matmuls, then a stable argsort of every head's bounds
     einsum_radix    the bound as matmuls, then the k-th largest bound found 8 bits at a time (4 passes of
                     256 counts each) and the pages at or above it kept in index order (no sort)
   Each variant's pages are checked against broadcast_topk's.
2. Reading the chosen pages. The store keeps a layer as [blocks, Hkv, units, 2 (K|V), 16, D] in pinned host
   memory; `paged_decode_attention_kv_with_lse` reads one combined pool, so the layer is the pool
   [blocks * Hkv * units, 2, 16, 1, D] (a reshape) and each KV head a "sequence" whose block table is its chosen
   rows. Variants (16 MiB read: 4096 tokens of K and V for 8 KV heads):
     device           the pool in GPU memory (reference speed and bits)
     host_splitsN     the pool in pinned host memory, read by the kernel over PCIe, N splits per KV head
     gather           today's path: gather the rows on the host (compute_on), one transfer, kernel on the copy
   Host variants report whether they equal the device bits and whether the compiled program copies the pool.
Timings: median (min, max) of 20 calls after a warm-up, each waited for. Prints JSON; writes probe_quest_layer.json
under $OUT when set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import call_seconds, run_metadata  # noqa: E402

import pallas_kernels  # noqa: E402
from jax_offload.kv.host_store import gather_rows  # noqa: E402
from jax_offload.sparse import quest  # noqa: E402

gpu = jax.default_backend() == "gpu"
HQ, HKV, D, UNIT = (32, 8, 128, 16) if gpu else (4, 2, 32, 16)
BLOCK = 1024 if gpu else 64
CONTEXT, BUDGET = (131072, 4096) if gpu else (1024, 128)
PAGE_COUNTS = (8192, 16384) if gpu else (64, 128)
CHOSEN = BUDGET // UNIT
dev = jax.devices()[0]
kinds = {m.kind for m in dev.addressable_memories()}
host = SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else "unpinned_host")
device = SingleDeviceSharding(dev, memory_kind="device")
rng = np.random.default_rng(0)
out: dict = run_metadata() | {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page": UNIT, "context": CONTEXT,
                              "budget": BUDGET, "host_memory_kind": host.memory_kind}


def timed(fn, *args) -> dict:
    ts = [t * 1e3 for t in call_seconds(lambda: fn(*args), 20)]
    return {"median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts))}


# ---- 1. choosing pages ------------------------------------------------------------------------------------------

def einsum_bound(q, kmin, kmax):
    """[Hkv, P]: the group's largest bound; relu(q) . max + min(q, 0) . min is sum_d max(q_d min_d, q_d max_d)."""
    qg = q.reshape(HKV, -1, D)
    hi = jnp.einsum("hgd,hpd->hgp", jnp.maximum(qg, 0), kmax, preferred_element_type=jnp.float32)
    lo = jnp.einsum("hgd,hpd->hgp", jnp.minimum(qg, 0), kmin, preferred_element_type=jnp.float32)
    return jnp.max(hi + lo, axis=1)


def masked(score, num_pages):
    page = jnp.arange(score.shape[1], dtype=jnp.int32)
    return jnp.where(page == 0, jnp.inf, jnp.where(page < num_pages, score, -jnp.inf))


def einsum_topk(q, kmin, kmax, num_pages):
    return quest.top_pages(einsum_bound(q, kmin, kmax), num_pages, CHOSEN)


def einsum_sort(q, kmin, kmax, num_pages):
    score = masked(einsum_bound(q, kmin, kmax), num_pages)
    chosen = jnp.argsort(-score, axis=-1, stable=True)[:, :CHOSEN].astype(jnp.int32)
    return jnp.sort(jnp.where(chosen < num_pages, chosen, score.shape[1]), axis=-1)


def einsum_radix(q, kmin, kmax, num_pages):
    score = masked(einsum_bound(q, kmin, kmax), num_pages)
    bits = jax.lax.bitcast_convert_type(score, jnp.int32)
    # Order-preserving unsigned keys: negative floats reversed, then the sign bit flipped.
    key = jax.lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits), jnp.uint32) ^ jnp.uint32(1 << 31)
    kth = jnp.zeros((key.shape[0], 1), jnp.uint32)
    digit = jnp.arange(256, dtype=jnp.uint32)
    for shift in (24, 16, 8, 0):
        cand = kth | (digit << shift)[None, :]  # [H, 256]
        counts = jnp.sum(key[:, :, None] >= cand[:, None, :], axis=1, dtype=jnp.int32)
        pick = jnp.sum(counts >= CHOSEN, axis=1, keepdims=True) - 1
        kth = jnp.take_along_axis(cand, pick, axis=1)
    above = key > kth
    ties = (key == kth) & (jnp.cumsum(key == kth, axis=1) <= CHOSEN - jnp.sum(above, axis=1, keepdims=True))
    take = above | ties
    slot = jnp.where(take, jnp.cumsum(take, axis=1) - 1, CHOSEN)
    page = jnp.broadcast_to(jnp.arange(key.shape[1], dtype=jnp.int32), key.shape)
    page = jnp.where(page < num_pages, page, key.shape[1])
    chosen = jnp.full((key.shape[0], CHOSEN + 1), key.shape[1], jnp.int32)
    chosen = chosen.at[jnp.arange(key.shape[0])[:, None], slot].set(page)
    return chosen[:, :CHOSEN]


def broadcast_topk(q, kmin, kmax, num_pages):
    return quest.select_pages(q, kmin, kmax, num_pages, CHOSEN)


for num_slots in PAGE_COUNTS:
    q = jnp.asarray(rng.standard_normal((HQ, D), np.float32), jnp.bfloat16)
    a, b = rng.standard_normal((2, HKV, num_slots, D), np.float32)
    kmin = jnp.asarray(np.minimum(a, b), jnp.bfloat16)
    kmax = jnp.asarray(np.maximum(a, b), jnp.bfloat16)
    num_pages = jnp.int32(CONTEXT // UNIT)
    reference = None
    for name, fn in [("broadcast_topk", broadcast_topk), ("einsum_topk", einsum_topk),
                     ("einsum_sort", einsum_sort), ("einsum_radix", einsum_radix)]:
        key = f"choose_{name}_P{num_slots}"
        try:
            step = jax.jit(fn)
            pages = np.asarray(step(q, kmin, kmax, num_pages))
            row = timed(step, q, kmin, kmax, num_pages)
            if reference is None:
                reference = pages
            else:
                row["same_pages"] = bool(np.array_equal(pages, reference))
                row["pages_differing_per_head"] = float(np.mean([len(set(x) ^ set(y)) / 2 for x, y in
                                                                 zip(pages, reference)]))
            out[key] = row
        except Exception as e:  # noqa: BLE001 - the probe reports what each attempt raised
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(key, out[key], flush=True)

# ---- 2. reading the chosen pages ---------------------------------------------------------------------------------

num_blocks = CONTEXT // BLOCK
units = BLOCK // UNIT
layer_np = rng.standard_normal((num_blocks, HKV, units, 2, UNIT, D), np.float32).astype(jnp.bfloat16)
q = jax.device_put(rng.standard_normal((HKV, HQ // HKV, D), np.float32).astype(jnp.bfloat16), device)
pages = np.stack([np.sort(rng.choice(CONTEXT // UNIT, CHOSEN, replace=False)) for _ in range(HKV)])
rows = jax.device_put(quest.page_rows(jnp.asarray(pages, jnp.int32), CONTEXT // UNIT, UNIT, BLOCK).reshape(HKV, -1),
                      device)
lens = jax.device_put(np.full(HKV, BUDGET, np.int32), device)
pool_rows = num_blocks * HKV * units
out["layer_MiB"], out["read_MiB"] = layer_np.nbytes / 2**20, 2 * HKV * BUDGET * D * 2 / 2**20
bits: list[np.ndarray] = []


def zero_copy(num_splits):
    def attention(q, layer, rows, lens):
        pool = layer.reshape(pool_rows, 2, UNIT, 1, D)
        return pallas_kernels.paged_decode_attention_kv_with_lse(q, pool, rows, lens, out_dtype=jnp.float32,
                                                                 num_splits=num_splits)
    return attention


def gathered(q, layer, rows, lens):
    kv = gather_rows(layer, rows.reshape(-1), host, device)  # [HKV * CHOSEN, 2, 16, D]
    local = jnp.arange(HKV * CHOSEN, dtype=jnp.int32).reshape(HKV, CHOSEN)
    return pallas_kernels.paged_decode_attention_kv_with_lse(q, kv[:, :, :, None], local, lens,
                                                             out_dtype=jnp.float32)


def attempt(name, fn, layer):
    try:
        step = jax.jit(fn)
        hlo = step.lower(q, layer, rows, lens).compile().as_text()
        o = np.asarray(step(q, layer, rows, lens)[0])
        row = timed(step, q, layer, rows, lens)
        row["GB_per_s"] = out["read_MiB"] * 2**20 / 1e9 / (row["median_ms"] / 1e3)
        copies = [line for line in hlo.splitlines() if " copy(" in line or "copy-start(" in line]
        row["copies_whole_layer"] = any(f"[{num_blocks},{HKV},{units}," in line or f"[{pool_rows},2,{UNIT},1,{D}]"
                                        in line for line in copies)
        if bits:
            row["equals_device_bits"] = bool(np.array_equal(o, bits[0]))
        else:
            bits.append(o)
        out[name] = row
    except Exception as e:  # noqa: BLE001 - the probe reports what each attempt raised
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(name, out[name], flush=True)


attempt("device", zero_copy(None), jax.device_put(layer_np, device))
layer_host = jax.device_put(layer_np, host)
for splits in ((4, 8, 16, 32, 64) if gpu else (4,)):
    attempt(f"host_splits{splits}", zero_copy(splits), layer_host)
attempt("gather", gathered, layer_host)
text = json.dumps(out, indent=1)
print(text)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_quest_layer.json").write_text(text + "\n")
