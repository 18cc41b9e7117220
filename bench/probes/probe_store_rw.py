"""Does writing or reading one block of a one-buffer ("pages") store layer cost more the larger the layer?

`bench/results/runs/h200_sketch_prefill/`: a sketch request's chunked prefill took ~1.8x a full-policy one; its
sparse layers keep their blocks in one pinned buffer per layer, written with `HostKVStore._write_into_layer` and read
with `_read_consecutive`, where full attention keeps one buffer per block. This times `write` and `fetch` of one
block for both places at two layer sizes (a cost that grows with the layer, not the block, shows up as a ratio
between the sizes) and saves the compiled modules of the one-buffer write and read.

    mkdir -p $OUT/store_rw; python bench/probes/probe_store_rw.py --contexts 32768,131072 --out $OUT/store_rw 2> $OUT/store_rw/stderr.txt

Keep stderr: XLA's host offloader logs "Found an instruction ... which does device compute in host memory space.
Converting into host compute" when it runs an op of a module on the CPU instead of moving only a slice.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import run_metadata, stats  # noqa: E402
from jax_offload.kv.host_store import HostKVStore  # noqa: E402
from jax_offload.tensor_parallel import TensorParallel  # noqa: E402

HKV, D = 8, 128  # Llama-3.1-8B's KV heads


def _wait(store: HostKVStore, layer: int, index: int) -> None:
    jax.block_until_ready(store._blocks[layer] if store.places[layer] != "blocks" else store._blocks[layer][index])


def time_layer(store: HostKVStore, layer: int, kv: jax.Array, group: int) -> dict:
    """Per-block write (each waited) and per-group fetch times of one layer, ms, after a write and a fetch that
    compile."""
    store.write(layer, 0, kv)
    jax.block_until_ready(store.fetch([(layer, 0)]))
    writes = []
    for i in range(store.num_blocks):
        t = time.perf_counter()
        store.write(layer, i, kv)
        _wait(store, layer, i)
        writes.append((time.perf_counter() - t) * 1e3)
    jax.block_until_ready(store.fetch([(layer, j) for j in range(group)]))
    fetches = []
    for first in range(0, store.num_blocks - group + 1, group):
        t = time.perf_counter()
        jax.block_until_ready(store.fetch([(layer, first + j) for j in range(group)]))
        fetches.append((time.perf_counter() - t) * 1e3 / group)
    return {"write_ms": stats(writes), "fetch_ms_per_block": stats(fetches)}


def compiled_text(store: HostKVStore, layer: int, kv: jax.Array) -> dict[str, str]:
    how = (store._sharding[layer], store.kv_cache_dtype, jnp.dtype(store.dtype))
    write = store._write_into_layer.lower(store._blocks[layer], kv, np.int32(0), *how).compile().as_text()
    read = store._read_consecutive.lower(store._blocks[layer], np.int32(0), 2, store.tp.sharding(1, "device"))
    return {"write_into_layer": write, "read_consecutive": read.compile().as_text()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--group", type=int, default=8, help="blocks fetched together (16 ring slots: 8)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tp = TensorParallel.create(1)
    kv = jax.random.normal(jax.random.PRNGKey(0), (2, a.block_size, HKV, D), jnp.bfloat16)
    rows = []
    for ctx in a.contexts:
        store = HostKVStore(2, ctx // a.block_size, a.block_size, HKV, D, jnp.bfloat16, tp, ["blocks", "pages"])
        for layer, place in enumerate(store.places):
            row = {"ctx": ctx, "place": place, "layer_GiB": store.num_blocks * store.block_bytes / 2**30,
                   **time_layer(store, layer, kv, min(a.group, store.num_blocks))}
            rows.append(row)
            print(json.dumps(row), flush=True)
        for name, text in compiled_text(store, 1, kv).items():
            (a.out / f"{name}_{ctx}.hlo.txt").write_text(text)
        del store
    (a.out / "probe_store_rw.json").write_text(json.dumps({"meta": run_metadata(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
