"""What the GPU benchmarks share: real model shapes with random weights, timing statistics, run metadata."""
from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "rope_scaling": _LLAMA3_ROPE,
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "rope_scaling": _LLAMA3_ROPE,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # A small Llama for checking the benchmark scripts on a CPU; no figure comes from it.
    "smoke": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "rope_scaling": _LLAMA3_ROPE,
    },
}


def read_json(path: Path):
    """A result file's content; large ones are kept gzipped (NAME.json.gz)."""
    import gzip
    import json

    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def result_files(folder: Path, pattern: str) -> list[Path]:
    """The files of `folder` matching `pattern` (NAME.json), gzipped (NAME.json.gz) or not, sorted by name."""
    return sorted([*folder.glob(pattern), *folder.glob(pattern + ".gz")], key=lambda p: p.name.removesuffix(".gz"))


def model_config(shape: str, num_layers: int | None = None):
    from jax_offload.config import ModelConfig

    raw = dict(SHAPES[shape])
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    return ModelConfig.from_dict(raw)


def random_params(cfg, dtype, seed: int = 0, tp=None):
    """Random weights at the config's shapes, drawn on the accelerator in `dtype` (no float32 temporaries).
    With a `TensorParallel` `tp`, each device draws only its shard (column-split wqkv and w_gate_up, row-split wo
    and w_down, the rest replicated), in the layout `LLM.from_params(tensor_parallel_size=tp.size)` expects."""
    import jax
    import jax.numpy as jnp

    from jax_offload.models.params import LayerParams, ModelParams

    key = jax.random.PRNGKey(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

    @functools.lru_cache(maxsize=None)
    def draw(shape, split_axis):
        out = None if tp is None else tp.sharding(split_axis)
        return jax.jit(lambda k: jax.random.normal(k, shape, dtype) * jnp.asarray(0.02, dtype), out_shardings=out)

    def rnd(k, shape, split_axis=None):
        return draw(shape, split_axis)(k)

    def norm(n):
        x = jnp.ones((n,), dtype)
        return x if tp is None else jax.device_put(x, tp.sharding(None))

    layers = []
    for n in range(cfg.num_layers):
        ks = jax.random.split(jax.random.fold_in(key, n), 4)
        layers.append(LayerParams(
            attn_norm=norm(h), wqkv=rnd(ks[0], (h, qkv), 1), bqkv=None,
            q_norm=norm(d) if cfg.qk_norm else None, k_norm=norm(d) if cfg.qk_norm else None,
            wo=rnd(ks[1], (cfg.num_heads * d, h), 0), mlp_norm=norm(h),
            w_gate_up=rnd(ks[2], (h, 2 * i), 1), w_down=rnd(ks[3], (i, h), 0),
            num_shards=1 if tp is None else tp.size))
    ks = jax.random.split(jax.random.fold_in(key, 10_000), 2)
    return ModelParams(embed=rnd(ks[0], (cfg.vocab_size, h)), layers=layers, final_norm=norm(h),
                       lm_head=None if cfg.tie_word_embeddings else rnd(ks[1], (h, cfg.vocab_size)))


class RandomModel:
    """A shape's model with random bf16 weights, laid out for `tp` (a `TensorParallel`; None: one device), and what
    a benchmark does with it: engines, prompts of random ids, greedy generations of `tokens` tokens and their
    timings over `repeats` runs. `min_positions` widens the model's window: positions past a checkpoint's window
    time like any other. `batch_invariant` (None: the engine's default) is every engine's mode unless a call says."""

    def __init__(self, shape: str, num_layers: int | None = None, tp=None, tokens: int = 8, repeats: int = 5,
                 min_positions: int = 0, batch_invariant: bool | None = None):
        import dataclasses

        import jax
        import numpy as np

        self.cfg = model_config(shape, num_layers)
        if min_positions > self.cfg.max_position_embeddings:
            self.cfg = dataclasses.replace(self.cfg, max_position_embeddings=min_positions)
        self.tp, self.tokens, self.repeats, self.batch_invariant = tp, tokens, repeats, batch_invariant
        self.params = random_params(self.cfg, jax.numpy.bfloat16, tp=tp)
        jax.block_until_ready(self.params)
        self.rng = np.random.default_rng(0)
        self.weights_GiB = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.params)) / GiB

    def llm(self, **options):
        from jax_offload import LLM

        if self.batch_invariant is not None:
            options.setdefault("batch_invariant", self.batch_invariant)
        return LLM.from_params(self.cfg, self.params, dtype="bfloat16",
                               tensor_parallel_size=self.tp.size if self.tp else 1, **options)

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(0, self.cfg.vocab_size, size=n).tolist()

    def prompt_len(self, ctx: int, tokens: int | None = None) -> int:
        # "128K" fills the model's window: the prompt leaves room for the generated tokens.
        return min(ctx, self.cfg.max_position_embeddings - (tokens or self.tokens) - 1)

    def generate(self, llm, n: int, tokens: int | None = None):
        from jax_offload import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=tokens or self.tokens, ignore_eos=True)
        return llm.generate([self.prompt(n)], params)[0]

    def timed(self, llm, n: int, tokens: int | None = None, warm_up: bool = True) -> dict:
        """`repeats` generations (after one at this length if `warm_up`): prefill seconds per run, decode ms of
        every step pooled, and the steps themselves (where a spread comes from is part of the result)."""
        if warm_up:
            self.generate(llm, n, tokens)
        prefill, steps = [], []
        for _ in range(self.repeats):
            out = self.generate(llm, n, tokens)
            prefill.append(out.prefill_seconds)
            steps += [s * 1e3 for s in out.decode_token_seconds]
        return {"prefill_s": stats(prefill), "decode_ms": stats(steps) if steps else None,
                "decode_steps_ms": [round(s, 3) for s in steps]}

    def warm_offload(self, llm, tokens: int | None = None, groups: int = 1) -> None:
        """Compiles every offloaded prefill and decode shape at short prompts: the last group of blocks holds 1 ..
        `groups` x half the ring's blocks, the tail starts empty or not; none depends on the prompt length."""
        from jax_offload.kv.ring import group_size

        bs = llm.engine_config.block_size
        for n in range(1, groups * group_size(llm.engine_config.num_ring_slots) + 2):
            self.generate(llm, n * bs, tokens)
        self.generate(llm, bs + 7, tokens)


def call_seconds(fn, reps: int) -> list[float]:
    """Seconds of `reps` calls of `fn`, each waited for (`jax.block_until_ready` of its result), after one untimed."""
    import time

    import jax

    jax.block_until_ready(fn())
    seconds = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - t)
    return seconds


def host_profile(run, orders: tuple[tuple[str, int], ...]) -> str:
    """The host's cProfile of `run()` as text: for each (sort key, count) in `orders`, that many functions."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    text = io.StringIO()
    for key, count in orders:
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(count)
    return text.getvalue()


def profiled(run):
    """`run()` under jax.profiler.trace; returns the trace as a `jax.profiler.ProfileData`."""
    import glob
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run()
        return jax.profiler.ProfileData.from_file(
            glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0])


def gpu_kernels(data) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every kernel and copy the GPUs' streams ran in a trace."""
    return [(e.name, e.start_ns, e.end_ns) for plane in data.planes if plane.name.startswith("/device:GPU")
            for line in plane.lines if line.name.startswith("Stream") for e in line.events]


def busy_ns(events: list[tuple[str, int, int]]) -> int:
    """The union of (name, start ns, end ns) intervals, sorted by start: the GPU's busy time over its streams."""
    busy, cur_s, cur_t = 0, None, None
    for _, s, t in events:
        if cur_t is None or s > cur_t:
            busy += 0 if cur_t is None else cur_t - cur_s
            cur_s, cur_t = s, t
        else:
            cur_t = max(cur_t, t)
    return busy + (0 if cur_t is None else cur_t - cur_s)


def decode_steps_by_kernel(data, steps_ms: list[float]) -> dict:
    """GPU time of decode steps 2.. of a profiled generate, read from its trace: the kernels in the trace's last
    window as long as those steps took by the engine's clock, per kernel name (digits dropped) and per step, with the
    union of busy GPU time over the streams, and the host's events that start in that window (`host_events`)."""
    import re

    events = sorted(((re.sub(r"[._]?\d+", "", name)[:70], s, t) for name, s, t in gpu_kernels(data)),
                    key=lambda e: e[1])
    if not events:
        raise SystemExit(f"no GPU kernels in the trace (steps {steps_ms} ms)")
    window = sum(steps_ms[1:]) * 1e6  # ns
    end = max(e[2] for e in events)
    inside = [e for e in events if e[1] >= end - window]
    per_name: dict[str, list[float]] = {}
    for name, s, t in inside:
        per_name.setdefault(name, []).append((t - s) / 1e3)
    busy = busy_ns(inside)
    n = len(steps_ms) - 1
    return {"window_ms": window / 1e6, "gpu_busy_ms_per_step": busy / 1e6 / n,
            "host_events_in_window": host_events(data, end - window, end),
            "per_kernel_ms_per_step": dict(sorted(
                ((k, {"count_per_step": len(v) / n, "ms_per_step": sum(v) / 1e3 / n}) for k, v in per_name.items()),
                key=lambda kv: -kv[1]["ms_per_step"]))}


def host_events(data, start_ns: float = float("-inf"), end_ns: float = float("inf"), top: int = 30) -> dict:
    """The host's traced events (XLA's, and Python's, marked $) that start in [start_ns, end_ns), by name: count and
    total ms (nested events each count their own time), the `top` largest."""
    host: dict[str, list[float]] = {}
    for plane in data.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for e in line.events:
                    if start_ns <= e.start_ns < end_ns:
                        entry = host.setdefault(e.name[:90], [0, 0.0])
                        entry[0] += 1
                        entry[1] += e.duration_ns / 1e6
    largest = sorted(host.items(), key=lambda kv: -kv[1][1])[:top]
    return {name: {"count": c, "total_ms": round(ms, 3)} for name, (c, ms) in largest}


def gpu_span_ms(fn, calls: int) -> list[float]:
    """GPU time in ms of each of `calls` waited calls of `fn`, read from a profiler trace: from the start of the
    call's first GPU kernel to the end of its last, gaps between them included. It counts no host work, which the
    older estimate (t_R - t_1) / (R - 1) of a program doing its work once and R times did where the host's share of
    a call grows with the program: on an H100, 30 layers of sketch scoring span 1.86 ms on the GPU while that
    estimate gave 2.10-2.16 (bench/results/runs/h100_sketch_timeline/)."""
    import jax

    def run():
        for i in range(calls):
            with jax.profiler.TraceAnnotation(f"gpu_span_call_{i}"):
                jax.block_until_ready(fn())

    jax.block_until_ready(fn())
    data = profiled(run)
    kernels = gpu_kernels(data)
    windows = sorted((e.start_ns, e.end_ns) for plane in data.planes for line in plane.lines for e in line.events
                     if e.name.startswith("gpu_span_call_"))
    spans, counts = [], []
    for lo, hi in windows:
        inside = [(start, end) for _, start, end in kernels if lo <= start < hi]
        counts.append(len(inside))
        if inside:
            spans.append((max(end for _, end in inside) - min(start for start, _ in inside)) / 1e6)
    if len(spans) != calls or len(set(counts)) != 1:
        raise RuntimeError(f"GPU kernels per traced call {counts}; expected the same nonzero count in each of "
                           f"{calls} calls (no GPU, or a program that varies between calls)")
    return spans


def run_phases(script: str, phases: list[tuple[str, list[str]]], phases_value: str, env: dict | None = None) -> None:
    """Runs each (label, arguments) phase as `script --run-phase ARGUMENTS...` in a fresh process (its own peak
    memory and compile caches), forwarding this command line's other arguments; prints how each ended."""
    import subprocess
    import time

    forwarded = [a for a in sys.argv[1:] if a not in ("--phases", phases_value)]
    for label, args in phases:
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, script, "--run-phase", *args, *forwarded], env=env).returncode
        print(f"phase {label}: exit {rc} in {time.perf_counter() - t:.0f} s", flush=True)


def probe_output(name: str) -> Path:
    """Where a probe writes its result file `name`: under $OUT (made if missing), else the working directory."""
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    return out / name


def add_batch_invariant_option(parser) -> None:
    """`--batch-invariant` / `--no-batch-invariant`, defaulting to the engine's mode (on since 2026-12-01)."""
    import argparse

    from jax_offload.config import EngineConfig

    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.batch_invariant,
                        help="the engine's batch-invariant mode (default on, as the engine's)")


def batch_invariant_label(meta: dict) -> str:
    """A result's mode for a report header; files without the key ran before the mode was the default (2026-12-01)."""
    if "batch_invariant" not in meta:
        return "batch_invariant=False (before the mode was the default)"
    return "batch-invariant" if meta["batch_invariant"] else "batch_invariant=False"


def stats(samples: list[float]) -> dict:
    """Median with min, max and count: how every timed figure is reported."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def matmul_ms(mm, x, ws, calls: int = 10, loops: int = 7) -> dict:
    """ms per matmul of `mm(x, w)` over the distinct weights `ws`, one jitted program multiplying by each: `loops`
    timings of `calls` programs back to back, after one untimed (`stats`)."""
    import time

    import jax

    program = jax.jit(lambda x, ws: [mm(x, w) for w in ws])
    jax.block_until_ready(program(x, ws))
    samples = []
    for _ in range(loops):
        t = time.perf_counter()
        jax.block_until_ready([program(x, ws) for _ in range(calls)])
        samples.append((time.perf_counter() - t) * 1e3 / (calls * len(ws)))
    return stats(samples)


def attempt(fn):
    """fn(), or {"error": ...} where it raised: a config a kernel refuses (shape, shared memory, lowering) is recorded
    in a probe's results, not fatal to the rest."""
    try:
        return fn()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def fmt(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """'median (min-max)' of a `stats` dict."""
    if not s:
        return "-"
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def run_metadata() -> dict:
    """Device, versions, date, the command line and the repository's commit (-dirty with local changes)."""
    import shlex
    import subprocess

    import jax

    try:
        commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "describe", "--always",
                                 "--dirty"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + shlex.join(sys.argv), "git": commit}
    try:
        import torch
        import transformers

        meta |= {"torch": torch.__version__, "transformers": transformers.__version__}
    except ImportError:
        pass
    return meta


def gpu_memory() -> dict:
    """Bytes in use now and the process's peak so far (0 where the backend keeps no statistics)."""
    import jax

    s = jax.devices()[0].memory_stats() or {}
    return {"in_use_GiB": s.get("bytes_in_use", 0) / GiB, "peak_GiB": s.get("peak_bytes_in_use", 0) / GiB}


def copy_rate(src, dst, nbytes: int, reps: int = 7) -> dict:
    """Bytes/s of `jax.device_put(src, dst)` counting `nbytes` per copy (stats over `reps` copies after one)."""
    import time

    import jax

    jax.device_put(src, dst).block_until_ready()
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.device_put(src, dst).block_until_ready()
        rates.append(nbytes / (time.perf_counter() - t))
    return stats(rates)


def h2d_bandwidth(nbytes: int = GiB, reps: int = 7) -> dict:
    """Pinned-host -> GPU copy bandwidth of one large transfer, bytes/s (stats over `reps` copies)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    host = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), SingleDeviceSharding(dev, memory_kind="pinned_host"))
    return copy_rate(host, SingleDeviceSharding(dev, memory_kind="device"), nbytes, reps)
