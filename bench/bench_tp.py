"""Tensor-parallel benchmark (issue 13): TP=1 against TP=2 on random bf16 weights.

Each phase runs in a fresh process (its peak memory its own) and writes phase_<name>_tp<N>.json:
  bandwidth   pinned-host -> GPU copies: each device's link alone, then every link at once (one sharded copy)
  offload     Llama-3.1-8B shape, KV offloaded, chunked prefill of a --offload-ctx prompt (128K), per-token decode,
              against the PCIe floor of the links (each device's host blocks / its link's rate with all links busy)
  in_gpu      Llama-3.1-8B shape, KV in GPU memory: per-token decode at --decode-ctx (8K), prefill of
              --prefill-ctx (32K)
  big         Llama-3.1-70B shape (80 layers, 64 heads, 8 KV heads, hidden 8192), KV offloaded: a --big-ctx prompt
              (128K) prefilled and --big-tokens (32) decoded; ms/token against the floor, peak GPU memory per device
  load        a random safetensors checkpoint (--load-shape, written once under --ckpt-dir) loaded sharded:
              seconds and the process's peak host memory (ru_maxrss; it counts the checkpoint's pages mapped by
              safetensors, which the kernel may drop, beside anonymous memory)
Phases take a tensor-parallel size as NAME:N. Every time is the median of >= --repeats runs after a warm-up
(decode figures pool every step of those runs) with min and max; the load is timed once. `--report DIR`
assembles tp.json and tp.md from the phase files.

    python bench/bench_tp.py --phases bandwidth,offload:1,offload:2 --out DIR     # one device call each line
    python bench/bench_tp.py --phases in_gpu:1,in_gpu:2,load:1,load:2 --out DIR
    python bench/bench_tp.py --phases big:2 --out DIR
    python bench/bench_tp.py --report DIR --out bench/results
    python bench/bench_tp.py --smoke --out /tmp/tp_smoke     # CPU, 2 virtual devices, tiny shapes, then --report
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GiB, SHAPES, RandomModel, copy_rate, fmt, model_config, run_metadata, run_phases,
)

from jax_offload.config import OFFLOAD_DEFAULTS  # noqa: E402

PHASES = ("bandwidth", "offload", "in_gpu", "big", "load")
DEFAULT_PHASES = "bandwidth,offload:1,offload:2,in_gpu:1,in_gpu:2,big:2,load:1,load:2"
SMOKE = dict(shape="smoke", big_shape="smoke", load_shape="smoke", offload_ctx=1024, decode_ctx=256, prefill_ctx=512,
             big_ctx=1024, big_tokens=4, block_size=128, decode_tokens=3, repeats=2, bandwidth_MiB=8)


# ---- measurements ---------------------------------------------------------------------------------


def link_bandwidth(tp, nbytes: int, reps: int = 7) -> dict:
    """Pinned-host -> device bytes/s: each device's link alone, and all links at once (one copy of an array split
    over the mesh, `nbytes` per device; the rate per link is the slowest device's share)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    elems = nbytes // 2
    alone = []
    for d in tp.mesh.devices.flat:
        host = jax.device_put(jnp.ones((elems,), jnp.bfloat16), SingleDeviceSharding(d, memory_kind="pinned_host"))
        alone.append(copy_rate(host, SingleDeviceSharding(d, memory_kind="device"), nbytes, reps))
        del host
    host = jax.device_put(tp.zeros((tp.size * elems,), jnp.bfloat16, 0), tp.sharding(0, "pinned_host"))
    together = copy_rate(host, tp.sharding(0, "device"), nbytes, reps)
    return {"bytes_per_device": nbytes, "alone_Bps": alone, "together_per_link_Bps": together,
            "together_total_Bps": {k: v * tp.size if k != "n" else v for k, v in together.items()}}


def device_memory(tp) -> list[dict]:
    """Per device of the mesh: bytes in use and the process's peak (0 where the backend keeps no statistics)."""
    out = []
    for d in tp.mesh.devices.flat:
        s = d.memory_stats() or {}
        out.append({"in_use_GiB": s.get("bytes_in_use", 0) / GiB, "peak_GiB": s.get("peak_bytes_in_use", 0) / GiB})
    return out


def _random_model(a, shape: str, tp_size: int):
    from jax_offload.tensor_parallel import TensorParallel

    return RandomModel(shape, tp=TensorParallel.create(tp_size), repeats=a.repeats)


def offload_row(m: RandomModel, a, ctx: int, tokens: int, warm_up: bool) -> dict:
    """Chunked prefill of a `ctx` prompt offloaded, then `tokens` decoded, timed as `RandomModel.timed`."""
    llm = m.llm(max_model_len=m.cfg.max_position_embeddings, offload=True, block_size=a.block_size,
                num_ring_slots=a.ring_slots, prefill="chunked")
    m.warm_offload(llm, 2)
    n = m.prompt_len(ctx, tokens)
    row = {"ctx": ctx, "prompt_tokens": n, "host_blocks": n // a.block_size,
           "ring_slots": llm.engine_config.num_ring_slots, **m.timed(llm, n, tokens, warm_up)}
    # Each device's share of the full blocks crosses its own link every step; the partial block stays on the GPU.
    row["pcie_bytes_per_device_step"] = (n // a.block_size) * a.block_size * m.cfg.kv_bytes_per_token // m.tp.size
    row["store_GiB"] = llm._runner.store.total_bytes / GiB
    return row


def _with_floor(row: dict, bandwidth: dict) -> dict:
    """The PCIe floor: each device's bytes at its link's rate while every link is busy."""
    floor = row["pcie_bytes_per_device_step"] / bandwidth["together_per_link_Bps"]["median"] * 1e3
    return row | {"floor_ms": floor, "decode_over_floor": row["decode_ms"]["median"] / floor}


# ---- phases ---------------------------------------------------------------------------------------


def phase_bandwidth(a, tp_size: int) -> dict:
    import jax

    from jax_offload.tensor_parallel import TensorParallel

    tp = TensorParallel.create(min(max(tp_size, 2), jax.device_count()))
    return {"links": link_bandwidth(tp, a.bandwidth_MiB * 2**20)}


def phase_offload(a, tp_size: int) -> dict:
    r = _random_model(a, a.shape, tp_size)
    row = offload_row(r, a, a.offload_ctx, a.decode_tokens, warm_up=True)
    row["gpu_memory"] = device_memory(r.tp)
    bw = link_bandwidth(r.tp, a.bandwidth_MiB * 2**20)
    return {"rows": [_with_floor(row, bw)], "links": bw, "weights_GiB_per_device": r.weights_GiB}


def phase_in_gpu(a, tp_size: int) -> dict:
    r = _random_model(a, a.shape, tp_size)
    llm = r.llm(max_model_len=max(a.decode_ctx + a.decode_tokens, a.prefill_ctx + 1) + 16)
    decode = {"ctx": a.decode_ctx, **r.timed(llm, a.decode_ctx, a.decode_tokens)}
    prefill = {"ctx": a.prefill_ctx, **r.timed(llm, a.prefill_ctx, 1)}
    return {"decode": decode, "prefill": prefill, "gpu_memory": device_memory(r.tp),
            "weights_GiB_per_device": r.weights_GiB}


def phase_big(a, tp_size: int) -> dict:
    r = _random_model(a, a.big_shape, tp_size)
    # No warm-up at the full length (one 128K prefill of this model takes most of a minute): the short warm-ups
    # compile every shape the timed runs use.
    row = offload_row(r, a, a.big_ctx, a.big_tokens, warm_up=False)
    row["gpu_memory"] = device_memory(r.tp)
    bw = link_bandwidth(r.tp, a.bandwidth_MiB * 2**20)
    return {"rows": [_with_floor(row, bw)], "links": bw, "weights_GiB_per_device": r.weights_GiB,
            "shape": a.big_shape}


def phase_load(a, tp_size: int) -> dict:
    import jax
    import jax.numpy as jnp

    from convert.safetensors_loader import load_params
    from jax_offload.tensor_parallel import TensorParallel

    ckpt = a.ckpt_dir / a.load_shape
    checkpoint_bytes = write_random_checkpoint(a.load_shape, ckpt)
    tp = TensorParallel.create(tp_size)
    before = _maxrss()
    t = time.perf_counter()
    params = load_params(ckpt, model_config(a.load_shape), jnp.bfloat16, tp)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params)) / GiB
    return {"shape": a.load_shape, "checkpoint_GiB": checkpoint_bytes / GiB, "load_s": seconds,
            "peak_rss_GiB": _maxrss(), "rss_before_GiB": before, "rss_now": _rss_now(),
            "weights_GiB_per_device": per_device, "gpu_memory": device_memory(tp)}


def _maxrss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rss_now() -> dict:
    """Resident memory now, anonymous and file-backed (the mapped checkpoint), GiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 2**20
    return fields


def write_random_checkpoint(shape: str, out: Path, shard_bytes: int = 5 * GiB) -> int:
    """A Hugging Face style bf16 safetensors checkpoint of random weights (sharded, with an index), written tensor
    by tensor from random bits so host memory stays small; kept and reused if present. -> bytes of weights."""
    import numpy as np

    from convert.safetensors_loader import expected_shapes

    index = out / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["metadata"]["total_size"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape]))
    shapes = expected_shapes(model_config(shape))
    files: list[list[str]] = [[]]
    size = 0
    for name, s in shapes.items():
        nbytes = 2 * int(np.prod(s))
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for i, names in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            nbytes = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name in names:
                left = int(np.prod(shapes[name]))
                while left:
                    n = min(left, 1 << 26)
                    # bf16 bits: random sign and mantissa, exponent 2^-7: values of magnitude 0.008 to 0.016.
                    bits = (rng.integers(0, 1 << 16, size=n, dtype=np.uint16) & 0x807F) | 0x3C00
                    f.write(bits.tobytes())
                    left -= n
        total += offset
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


# ---- report ---------------------------------------------------------------------------------------


def report(src: Path, out: Path) -> None:
    phases = {p.stem[len("phase_"):]: json.loads(p.read_text()) for p in sorted(src.glob("phase_*.json"))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp.json").write_text(json.dumps(phases, indent=1))
    meta = next(iter(phases.values()))["meta"]
    gb = lambda s: fmt(s, 1e-9, 1)  # noqa: E731
    lines = ["# Tensor-parallel benchmark, random bf16 weights", "",
             f"{meta['device']} x {meta['devices']} | jax {meta['jax']} | {meta['date']}", "",
             f"Every time is the median (min-max) of >= {meta['repeats']} runs after a warm-up; decode figures pool every "
             "step of those runs. Floor = each device's share of the full host blocks / its link's rate while every "
             "link copies at once (measured in the same process).", ""]
    bw = phases.get("bandwidth_tp2") or phases.get("bandwidth_tp1")
    if bw:
        links = bw["links"]
        lines += ["| pinned host -> GPU | GB/s |", "|---|---|"]
        lines += [f"| device {i} alone | {gb(s)} |" for i, s in enumerate(links["alone_Bps"])]
        lines += [f"| all {len(links['alone_Bps'])} at once, per link | {gb(links['together_per_link_Bps'])} |",
                  f"| all at once, total | {gb(links['together_total_Bps'])} |", ""]
    rows = []
    for name in sorted(phases):
        p = phases[name]
        kind, tp = name.rsplit("_tp", 1)
        shape = p["meta"]["shape"] if kind != "big" else p["shape"]
        def peak(memory: list[dict]) -> str:
            return "/".join(f"{m['peak_GiB']:.1f}" for m in memory)

        if kind in ("offload", "big"):
            for r in p["rows"]:
                rows.append(f"| {shape} | {tp} | offloaded, chunked prefill | {r['prompt_tokens']} | "
                            f"{fmt(r['prefill_s'], 1, 2)} | {fmt(r['decode_ms'])} | {r['floor_ms']:.1f} | "
                            f"{r['decode_over_floor']:.2f} | {p['weights_GiB_per_device']:.1f} | {peak(r['gpu_memory'])} |")
        elif kind == "in_gpu":
            rows.append(f"| {shape} | {tp} | in GPU memory, decode | {p['decode']['ctx']} | - | "
                        f"{fmt(p['decode']['decode_ms'])} | - | - | {p['weights_GiB_per_device']:.1f} | "
                        f"{peak(p['gpu_memory'])} |")
            rows.append(f"| {shape} | {tp} | in GPU memory, prefill | {p['prefill']['ctx']} | "
                        f"{fmt(p['prefill']['prefill_s'], 1, 3)} | - | - | - | {p['weights_GiB_per_device']:.1f} | "
                        f"{peak(p['gpu_memory'])} |")
    if rows:
        lines += ["| shape | TP | engine | tokens | prefill s | decode ms/token | floor ms | decode / floor | "
                  "weights GiB per device | peak GiB per device |", "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    loads = [(name, p) for name, p in sorted(phases.items()) if name.startswith("load_")]
    if loads:
        lines += ["| load (one run) | TP | checkpoint GiB | seconds | peak host RSS GiB | RSS after: anon / file GiB | "
                  "weights GiB per device |", "|---|---|---|---|---|---|---|"]
        for name, p in loads:
            now = p["rss_now"]
            lines.append(f"| {p['shape']} | {name.rsplit('_tp', 1)[1]} | {p['checkpoint_GiB']:.2f} | {p['load_s']:.1f} | "
                         f"{p['peak_rss_GiB']:.2f} | {now.get('RssAnon', 0):.2f} / {now.get('RssFile', 0):.2f} | "
                         f"{p['weights_GiB_per_device']:.2f} |")
        lines += ["", "Peak RSS counts the checkpoint pages safetensors maps (file-backed, droppable), not only "
                  "anonymous memory."]
    lines += ["", "bf16 under TP is not bitwise TP=1: the row-parallel all-reduce adds the partial sums in another "
              "order (float32 agrees within 1e-5, tests/test_tp.py)."]
    (out / "tp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import plots

    plots.tensor_parallel(src, out / "tp.png")


# ---- driver ---------------------------------------------------------------------------------------


def run_phase(args) -> None:
    import jax

    name, tp_size = args.run_phase, args.tp
    result = globals()[f"phase_{name}"](args, tp_size)
    result["meta"] = run_metadata() | {"devices": jax.device_count(), "shape": args.shape, "tp": tp_size,
                                       "block_size": args.block_size, "ring_slots": args.ring_slots,
                                       "repeats": args.repeats, "max_rss_GiB": _maxrss()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"phase_{name}_tp{tp_size}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "meta"})[:2000], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results/tp")))
    p.add_argument("--phases", default=DEFAULT_PHASES, help=f"NAME:TP, comma-separated; names: {','.join(PHASES)}")
    p.add_argument("--run-phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help="assemble tp.md/json from the phase files in this folder")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on 2 virtual CPU devices, to check the script")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--big-shape", default="llama-3.1-70b")
    p.add_argument("--load-shape", default="llama-3.1-8b")
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/jax_offload_bench_ckpt"))
    p.add_argument("--offload-ctx", type=int, default=131072)
    p.add_argument("--decode-ctx", type=int, default=8192)
    p.add_argument("--prefill-ctx", type=int, default=32768)
    p.add_argument("--big-ctx", type=int, default=131072)
    p.add_argument("--big-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=OFFLOAD_DEFAULTS["block_size"])
    p.add_argument("--ring-slots", type=int, help="default: the engine's, 16 x the TP size")
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth-MiB", type=int, default=1024)
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.report:
        report(args.report, args.out)
        return
    if args.run_phase:
        run_phase(args)
        return
    env = dict(os.environ)
    if args.smoke:
        env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    phases = [(item, [item.partition(":")[0], "--tp", item.partition(":")[2] or "1"])
              for item in args.phases.split(",") if item]
    run_phases(__file__, phases, args.phases, env)
    if args.smoke:
        report(args.out, args.out)


if __name__ == "__main__":
    main()
