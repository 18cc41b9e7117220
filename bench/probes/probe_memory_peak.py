"""Which program sets an offloaded request's peak GPU memory (the 512K fp8 sketch run peaked at 51.4 GiB against
25.7 in use after, full decode at 19.3 against 15.2: `bench/results/runs/h100_kv_fp8_long/`).

Every jitted function the offload runner, the store, the ring and the sketch call (module-level, found by name), and
`jax.device_put`, is wrapped to wait for its result and read the device's peak_bytes_in_use: each rise of the peak is
charged to the program that just ran (with how many times it had run). Llama-3.1-8B shape, random bf16
weights, fp8 KV, chunked prefill in --block-size chunks with XAttention at a fixed density, as `bench_kv_fp8.py
--phases long` runs it, one prompt per policy (each in its own process: the peak is the process's).

    python bench/probes/probe_memory_peak.py --policy sketch --ctx 131072 --out $OUT/mem
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

p = argparse.ArgumentParser()
p.add_argument("--policy", default="sketch")
p.add_argument("--ctx", type=int, default=131072)
p.add_argument("--block-size", type=int, default=16384)
p.add_argument("--density", type=float, default=0.05)
p.add_argument("--tokens", type=int, default=3)
p.add_argument("--shape", default="llama-3.1-8b")
p.add_argument("--num-layers", type=int, help="fewer layers, for a smoke run")
p.add_argument("--phases-only", action="store_true",
               help="no per-program waits (long prompts): only the peaks after construction, prefill and decode")
p.add_argument("--out", type=Path, required=True)
a = p.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import GiB, model_config, random_params, run_metadata  # noqa: E402
from jax_offload import LLM, SamplingParams  # noqa: E402
from jax_offload import offload_runner  # noqa: E402
from jax_offload.kv import host_store, ring  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402

RISES: list[dict] = []
CALLS: dict[str, int] = {}
STATE = {"peak": 0}


def _stats() -> tuple[int, int]:
    s = jax.devices()[0].memory_stats() or {}
    return s.get("peak_bytes_in_use", 0), s.get("bytes_in_use", 0)


def _watched(name: str, fn):
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        CALLS[name] = CALLS.get(name, 0) + 1
        peak, in_use = _stats()
        if peak > STATE["peak"]:
            RISES.append({"after": name, "call": CALLS[name], "peak_GiB": peak / GiB, "in_use_GiB": in_use / GiB,
                          "rise_GiB": (peak - STATE["peak"]) / GiB})
            STATE["peak"] = peak
        return out
    return run


def _watch_modules() -> list[str]:
    names = []
    for module in (offload_runner, host_store, ring, sketch):
        for name, fn in list(vars(module).items()):
            if callable(fn) and hasattr(fn, "lower") and not isinstance(fn, type):
                setattr(module, name, _watched(f"{module.__name__.split('.')[-1]}.{name}", fn))
                names.append(f"{module.__name__}.{name}")
    for cls in (host_store.HostKVStore, sketch.KeySketch, offload_runner.OffloadRunner):
        for name, attr in list(vars(cls).items()):
            fn = attr.__func__ if isinstance(attr, staticmethod) else attr
            if callable(fn) and hasattr(fn, "lower"):
                setattr(cls, name, staticmethod(_watched(f"{cls.__name__}.{name}", fn)))
                names.append(f"{cls.__name__}.{name}")
    jax.device_put = _watched("jax.device_put", jax.device_put)
    return names


def main() -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(a.shape, a.num_layers)
    n = a.ctx
    window = n + a.tokens + a.block_size
    rope = dataclasses.replace(cfg.rope, factor=max(cfg.rope.factor, cfg.rope.factor * window / cfg.max_position_embeddings))
    cfg = dataclasses.replace(cfg, max_position_embeddings=window, rope=rope)
    params = random_params(cfg, jnp.bfloat16)
    jax.block_until_ready(params)
    params_peak, params_in_use = _stats()
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=n).tolist()
    extra = (dict(decode_policy=a.policy, decode_budget=4096, page_size=16, dense_layers=2,
                  **({"sketch_dtype": "int4"} if a.policy == "sketch" else {})) if a.policy != "full" else {})
    llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=a.block_size, prefill="chunked",
                          max_model_len=n + a.tokens + 1, kv_cache_dtype="fp8", prefill_policy="xattention",
                          xattn_density=a.density, xattn_stride=8, xattn_block=128, **extra)
    start_peak, start_in_use = _stats()
    STATE["peak"] = start_peak
    watched = [] if a.phases_only else _watch_modules()
    decode = offload_runner.OffloadRunner.decode
    at_first_decode = {}

    def first_decode_seen(self, x, *args, **kwargs):  # the prefill's work is done once its output is
        if not at_first_decode:
            jax.block_until_ready(x)
            peak, in_use = _stats()
            at_first_decode.update(peak=peak / GiB, in_use=in_use / GiB)
        return decode(self, x, *args, **kwargs)

    offload_runner.OffloadRunner.decode = first_decode_seen
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True))[0]
    end_peak, end_in_use = _stats()
    result = {"meta": run_metadata(), "args": {k: str(v) for k, v in vars(a).items()}, "watched": watched,
              "params_GiB": {"peak": params_peak / GiB, "in_use": params_in_use / GiB},
              "before_GiB": {"peak": start_peak / GiB, "in_use": start_in_use / GiB},
              "after_GiB": {"peak": end_peak / GiB, "in_use": end_in_use / GiB},
              "at_first_decode_GiB": at_first_decode,
              "prefill_s": out.prefill_seconds, "mirror": llm._runner.last_prefill_mirror,
              "calls": CALLS, "rises": RISES}
    (a.out / f"probe_memory_peak_{a.policy}_{n}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("params_GiB", "before_GiB", "at_first_decode_GiB", "after_GiB", "prefill_s",
                                                 "mirrored")}))
    top = sorted(RISES, key=lambda r: -r["rise_GiB"])[:8]
    for r in top:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
