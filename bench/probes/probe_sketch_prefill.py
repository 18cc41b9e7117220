"""Chunked prefill of an offloaded request with a page policy (sketch) against full attention, in one process.

`bench/results/runs/h200_sketch_prefill/`: a chunked prefill reads each chunk's earlier blocks of a "pages" layer back;
XLA runs the program that slices them out of the layer's pinned buffer in order with compute
(`probe_pinned_overlap.py`), so the store keeps a prefill mirror of those blocks (`HostKVStore.start_mirror`). This
times `prefill_s` of LLM.generate (one token) per config, Llama-3.1-8B shape, random bf16 weights, 16 ring slots,
block 4096: a warm-up prompt of 10 blocks (every group size), then per context one cold run and `--repeats` timed
runs, with JAX's compile events counted in each (a cold run that compiles shows there). A config is
POLICY:PREFILL[:nomirror]; "nomirror" turns the mirror off for an A/B in the same process.

    python bench/probes/probe_sketch_prefill.py --configs full:chunked,sketch:chunked,sketch:chunked:nomirror --out $OUT/ab
    python bench/probes/probe_sketch_prefill.py --root OLD_TREE --configs sketch:chunked --out $OUT/old
    python bench/probes/probe_sketch_prefill.py --configs sketch:chunked --kv-cache-dtype fp8 --xattn-density 0.05 ...
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
               help="the tree whose jax_offload runs (an older checkout for an A/B)")
p.add_argument("--configs", type=lambda s: [c.split(":") for c in s.split(",")],
               default=[["full", "chunked"], ["sketch", "chunked"]])
p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--block-size", type=int, default=4096)
p.add_argument("--ring-slots", type=int, default=16)
p.add_argument("--shape", default="llama-3.1-8b")
p.add_argument("--kv-cache-dtype", default="auto")
p.add_argument("--xattn-density", type=float, default=None,
               help="XAttention prefill at this density (default: full prefill attention)")
p.add_argument("--out", type=Path, required=True)
a = p.parse_args()
BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import model_config, random_params, run_metadata, stats  # noqa: E402

sys.path.insert(0, str(a.root))  # after `common`, which puts this checkout's root first
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload.kv.host_store import HostKVStore  # noqa: E402

if not Path(sys.modules["jax_offload"].__file__).resolve().is_relative_to(a.root.resolve()):
    raise SystemExit(f"jax_offload came from {sys.modules['jax_offload'].__file__}, not from --root {a.root}.")

MIRROR = getattr(HostKVStore, "start_mirror", None)

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
EVENTS: list[tuple[str, float]] = []  # JAX's timed events (tracing, lowering, compiling) since the last run began


def _record(event: str, duration: float, **_) -> None:
    EVENTS.append((event, duration))


def _compile_seconds() -> dict[str, float]:
    """Seconds per JAX event kind since the last call, and how many."""
    out: dict[str, float] = {}
    for event, duration in EVENTS:
        out[event] = out.get(event, 0.0) + duration
        out[event + ":count"] = out.get(event + ":count", 0) + 1
    EVENTS.clear()
    return out


def main() -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    jax.monitoring.register_event_duration_secs_listener(_record)
    cfg = model_config(a.shape)
    params = random_params(cfg, jnp.bfloat16)
    rng = np.random.default_rng(0)
    bs = a.block_size
    rows = []
    for policy, mode, *how in a.configs:
        if hasattr(HostKVStore, "start_mirror"):  # "nomirror": the store reads "pages" blocks as before the mirror
            HostKVStore.start_mirror = MIRROR if how != ["nomirror"] else (lambda self, num_blocks: False)
        extra = dict(decode_policy=policy, decode_budget=4096, page_size=16, dense_layers=2) if policy != "full" else {}
        if a.kv_cache_dtype != "auto":
            extra["kv_cache_dtype"] = a.kv_cache_dtype
        if a.xattn_density is not None:
            extra.update(prefill_policy="xattention", xattn_density=a.xattn_density, xattn_stride=8, xattn_block=128)
        llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=bs, num_ring_slots=a.ring_slots,
                              max_model_len=min(max(max(a.contexts), 10 * bs + 7) + bs, cfg.max_position_embeddings),
                              prefill=mode, **extra)

        def prefill_s(n: int) -> float:
            ids = rng.integers(3, cfg.vocab_size, size=n).tolist()
            return llm.generate([ids], ONE)[0].prefill_seconds

        t = time.perf_counter()
        prefill_s(10 * bs + 7)
        warm_up_s = time.perf_counter() - t
        warm_up_events = _compile_seconds()
        for ctx in a.contexts:
            ctx = min(ctx, cfg.max_position_embeddings - 2)  # room for the generated token
            cold = prefill_s(ctx)
            cold_events = _compile_seconds()
            runs = [prefill_s(ctx) for _ in range(a.repeats)]
            row = {"policy": policy, "prefill": mode, "mirror": how != ["nomirror"], "ctx": ctx, "prefill_s": stats(runs), "runs": runs,
                   "cold_s": cold, "warm_up_s": warm_up_s, "warm_up_events": warm_up_events,
                   "cold_events": cold_events, "timed_events": _compile_seconds()}
            row["mirrored"] = getattr(llm._runner, "last_prefill_mirrored", None)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (a.out / "probe_sketch_prefill.json").write_text(json.dumps(
                {"meta": run_metadata(), "root": str(a.root), "args": {k: str(v) for k, v in vars(a).items()},
                 "rows": rows}, indent=1))
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
