"""Probe: Quest's attention reading its chosen pages straight from pinned host memory, with the paged decode kernel.

probe_pinned_pallas (H200) showed a Pallas kernel can read rows of a pinned_host array without XLA copying the
array: 16 MiB of random 8 KiB rows in 0.54 ms, against ~1.3 ms per layer for today's host gather + transfer
(probe_host_gather). Quest chooses pages per KV head, so its attention is the paged decode kernel with one
"sequence" per KV head: q [Hkv, group, D], K and V as pools of one-head pages [Hkv * pages_per_head, page, 1, D]
and, as block tables, each head's chosen pages. One layer of the 8B shape at 128K, budget 4096 tokens per KV head,
page 16. The host store keeps a page's K and V side by side ([blocks, Hkv, pages, 2, 16, D]): a flat page index
(block, head, page) is a reshape, but separate K and V pools are not, so building Quest on this needs the kernel to
read one [P, 2, page, D] pool (a BlockSpec change); the probe times the separate-pool form, the same bytes.
Variants, each timed (median of 20 after a warm-up, each call waited for) or reported with the error it raised:
  device       the pool in GPU memory (reference speed and bits)
  host         the same call with the pool in pinned host memory, at the kernel's default splits
  host_splitsN the host pool with N page splits (more programs in flight over PCIe)
Each host variant reports whether its output equals the device variant's bit for bit and whether the compiled
program copies the whole pool. Prints JSON; writes probe_quest_host_attention.json under $OUT when set.
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

gpu = jax.default_backend() == "gpu"
HKV, GROUP, D, PAGE = (8, 4, 128, 16) if gpu else (2, 2, 32, 16)
CONTEXT, BUDGET = (131072, 4096) if gpu else (1024, 128)
PAGES_PER_HEAD, CHOSEN = CONTEXT // PAGE, BUDGET // PAGE
dev = jax.devices()[0]
kinds = {m.kind for m in dev.addressable_memories()}
host = SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else "unpinned_host")
device = SingleDeviceSharding(dev, memory_kind="device")
rng = np.random.default_rng(0)
pool_shape = (HKV * PAGES_PER_HEAD, PAGE, 1, D)
k_np = rng.standard_normal(pool_shape, np.float32).astype(jnp.bfloat16)
v_np = rng.standard_normal(pool_shape, np.float32).astype(jnp.bfloat16)
q = jax.device_put(rng.standard_normal((HKV, GROUP, D), np.float32).astype(jnp.bfloat16), device)
chosen = np.stack([np.sort(rng.choice(PAGES_PER_HEAD, CHOSEN, replace=False)) + h * PAGES_PER_HEAD
                   for h in range(HKV)]).astype(np.int32)
tables = jax.device_put(chosen, device)
seq_lens = jax.device_put(np.full(HKV, BUDGET, np.int32), device)
out: dict = run_metadata() | {"kv_heads": HKV, "group": GROUP, "head_dim": D,
             "page": PAGE, "context": CONTEXT, "budget": BUDGET, "pool_MiB": 2 * k_np.nbytes / 2**20,
             "read_MiB": 2 * HKV * BUDGET * D * 2 / 2**20, "host_memory_kind": host.memory_kind}
reference: list[np.ndarray] = []


def attempt(name: str, k, v, num_splits: int | None = None) -> None:
    def attention(q, k, v, tables, seq_lens):
        return pallas_kernels.paged_decode_attention_with_lse(q, k, v, tables, seq_lens, out_dtype=jnp.float32,
                                                              num_splits=num_splits)

    try:
        step = jax.jit(attention)
        args = (q, k, v, tables, seq_lens)
        hlo = step.lower(*args).compile().as_text()
        o = np.asarray(step(*args)[0])
        ts = [t * 1e3 for t in call_seconds(lambda: step(*args), 20)]
        row = {"median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts)),
               "GB_per_s": out["read_MiB"] * 2**20 / 1e9 / (float(np.median(ts)) / 1e3),
               "copies_whole_pool": any(f"[{pool_shape[0]},{PAGE},1,{D}]" in line
                                        and (" copy(" in line or "copy-start(" in line) for line in hlo.splitlines())}
        if reference:
            row["equals_device_bits"] = bool(np.array_equal(o, reference[0]))
        else:
            reference.append(o)
        out[name] = row
    except Exception as e:  # noqa: BLE001 - the probe reports what each attempt raised
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(name, out[name], flush=True)


attempt("device", jax.device_put(k_np, device), jax.device_put(v_np, device))
k_host, v_host = jax.device_put(k_np, host), jax.device_put(v_np, host)
attempt("host", k_host, v_host)
for splits in (16, 64, CHOSEN):
    attempt(f"host_splits{splits}", k_host, v_host, splits)
text = json.dumps(out, indent=1)
print(text)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_quest_host_attention.json").write_text(text + "\n")
