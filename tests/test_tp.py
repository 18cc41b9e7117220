"""Tensor parallelism reorders work only: TP=2 and TP=4 on virtual CPU devices, and TP=2 as two processes, give
the TP=1 float32 logits (within 1e-5: the row-parallel sums add in another order) and the same greedy tokens.

Several devices need a fresh JAX (this process already started with one), so the runs happen in subprocesses
(`tp_check.py`); the checks and their messages are here.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams

HERE = Path(__file__).resolve().parent
# Llama, Qwen3 and Qwen2 with 1, 2 and 4 KV heads: with fewer KV heads than devices each KV head is repeated.
MODELS = {"llama_tied": 301, "qwen3": 302, "qwen2_kv4": 303}
PROMPT_SEED = 304
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    for variant, seed in MODELS.items():
        tiny_models.build(variant, root / variant, seed=seed)
    return {variant: root / variant for variant in MODELS}


def _cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


def _device_runs(model_dirs) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "tp_check.py"), "devices", str(PROMPT_SEED), *map(str, model_dirs.values())],
        # conftest.py's compile flags (the subprocess compiles dozens of tiny programs and runs each once or twice;
        # TP and its TP=1 reference are compiled alike) and 4 virtual devices.
        env=_cpu_env(XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_tp_on_virtual_devices_equals_tp1(model_dirs):
    """One test for everything the virtual-device subprocess checks (it takes minutes): as separate tests, each
    xdist worker would run it again."""
    device_runs = _device_runs(model_dirs)
    _check_logits_and_greedy_tokens(device_runs)
    _check_batch_equals_one_at_a_time(device_runs)
    _check_batched_page_cache(device_runs)
    _check_batched_xattn_in_gpu(device_runs)
    _check_preemption(device_runs)
    _check_only_all_reduce(device_runs)
    _check_batch_invariant(device_runs)


def _check_logits_and_greedy_tokens(device_runs):
    rows = [r for r in device_runs if "mode" in r and "case" not in r]
    # Llama and Qwen3 at TP=2 in GPU memory and chunked-offloaded, Qwen2 chunked-offloaded, Qwen3 at TP=4 in GPU
    # memory, and at TP=2 XAttention prefill in GPU memory and chunked-offloaded, Quest decode and sketch decode
    # (float32 and fp8 store, and float32 with the page cache).
    assert len(rows) == 2 * 2 + 1 + 1 + 6
    for r in rows:
        case = f"{r['model']} (model seed {MODELS[r['model']]}), TP={r['size']}, {r['mode']}, prompt seed {PROMPT_SEED}"
        # An fp8 store rounds TP's reordered sums to fp8 steps: bounded by fp8's own error (tp_check.FP8_MODE).
        bound = r["fp8_error"] / 100 if "fp8_error" in r else TOLERANCE
        assert r["max_diff"] <= bound, f"{case}: logits differ from TP=1 by {r['max_diff']} (allowed {bound})"
        assert r["tokens"] == r["ref_tokens"], f"{case}: greedy tokens differ from TP=1"


def _check_batch_equals_one_at_a_time(device_runs):
    """Several prompts at TP=2 run together (continuous batching) over the split host store offloaded, Llama (its one
    KV head repeated on both devices); over the split paged pool in GPU memory: the preempted case."""
    rows = [r for r in device_runs if r.get("case") == "batched"]
    assert len(rows) == 1
    for r in rows:
        case = (f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, {r['mode']}, 4 prompts together, prompt seed "
                f"{PROMPT_SEED}+i")
        assert r["tokens"] == r["ref_tokens"], f"{case}: greedy tokens differ from TP=1 one at a time"
        assert r["largest_batch"] == 4, case


def _check_batched_page_cache(device_runs):
    """Sketch decode with a page cache of two regions at TP=2: three prompts together (two read through regions split
    by KV heads, one from the store) give each one's tokens alone at TP=2, and no region is held after."""
    (r,) = [r for r in device_runs if r.get("case") == "batched_page_cache"]
    case = f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, sketch, page cache, prompt seed {PROMPT_SEED}+i"
    assert r["regions"] == 2 and r["regions_in_use"] == 0, case
    assert r["tokens"] == r["ref_tokens"], f"{case}: greedy tokens together differ from each alone"


def _check_batched_xattn_in_gpu(device_runs):
    """XAttention prefill in GPU memory at TP=2 on the batch engine: three prompts together give each one's tokens
    alone at TP=2."""
    (r,) = [r for r in device_runs if r.get("case") == "batched_xattn_in_gpu"]
    case = (f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, XAttention in GPU memory, "
            f"prompt seed {PROMPT_SEED}+i")
    assert r["largest_batch"] == 3, case
    assert r["tokens"] == r["ref_tokens"], f"{case}: greedy tokens together differ from each alone"


def _check_preemption(device_runs):
    """At TP=2 in GPU memory a 20-block pool forces preemption: each device's share of a request's blocks goes to
    host memory and back, or with no swap space the request is recomputed; the tokens are TP=1's."""
    (r,) = [r for r in device_runs if r.get("case") == "preempted"]
    for name, counter in (("swap", "swap_outs"), ("recompute", "recomputes")):
        case = f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, {name}, prompt seed {PROMPT_SEED}+i"
        assert r[name][counter] > 0, f"{case}: no request was preempted that way"
        assert r[name]["tokens"] == r["ref_tokens"], f"{case}: greedy tokens differ from TP=1 one at a time"


def _check_only_all_reduce(device_runs):
    """XLA's collectives are the two all-reduces of the row-parallel wo and w_down per layer; attention is local."""
    steps = next(r["steps"] for r in device_runs if r.get("case") == "collectives")
    layer_ends = {"all-reduce": 2, "all-gather": 0, "all-to-all": 0, "collective-permute": 0, "reduce-scatter": 0}
    for name in ("prefill_layer_in_device", "decode_layer_in_device", "chunk_end"):
        assert steps[name] == layer_ends, name
    for name in ("chunk_begin", "attend_blocks"):
        assert sum(steps[name].values()) == 0, f"{name}: {steps[name]}"


def _check_batch_invariant(device_runs):
    """batch_invariant=True at TP=2 (bfloat16, Pallas kernels): 4 prompts together give each one's greedy tokens
    alone; logits within bfloat16 rounding of TP=1's (the row-parallel products are added in another order); the
    matmuls run on each device's shard, their products gathered and added in device order (no all-reduce, whose
    order may change with the batch)."""
    (r,) = [r for r in device_runs if r.get("case") == "batch_invariant"]
    case = f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, bf16, batch_invariant, prompt seed {PROMPT_SEED}+i"
    assert r["largest_batch"] == 4, case
    assert r["together"] == r["alone"], f"{case}: greedy tokens together differ from each alone"
    assert r["max_diff"] <= 2**-6 * r["ref_max"], f"{case}: logits differ from TP=1 by {r['max_diff']}"
    assert r["collectives"]["all-reduce"] == 0 and r["collectives"]["all-gather"] == 2, f"{case}: {r['collectives']}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_give_tp1_logits(model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    out = tmp_path / "process0.json"
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "tp_check.py"), "process", str(port), str(i), str(PROMPT_SEED), str(model), str(out)],
        env=_cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, logs):
        assert p.returncode == 0, err[-3000:]
    got = json.loads(out.read_text())
    assert (got["devices"], got["local_devices"]) == (2, 1)
    ids = np.random.default_rng(PROMPT_SEED).integers(3, 256, size=37).tolist()
    llm = LLM(model, dtype="float32")
    ref_logits = llm.logits(ids)
    ref_tokens = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    diff = np.abs(np.asarray(got["chunked"]["logits"]) - ref_logits).max()
    case = f"2 processes, chunked offload, model seed {MODELS['qwen3']}, prompt seed {PROMPT_SEED}"
    assert diff <= TOLERANCE, f"{case}: logits differ from TP=1 by {diff}"
    assert got["chunked"]["tokens"] == ref_tokens, case


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not split the model's 2 KV heads, 4 attention heads "
                                   "and MLP of 128; valid sizes: 1, 2, 4"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size 2 exceeds the 1 devices JAX sees"),
    (dict(tensor_parallel_size=4, offload=True, decode_policy="quest", decode_budget=64),
     "decode_policy='quest' with tensor_parallel_size 4 needs at least 4 KV heads; the model has 2"),
])
def test_bad_tensor_parallel_size(model_dirs, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(model_dirs["qwen3"], dtype="float32", **options)


def test_cli_passes_tensor_parallel_size(model_dirs, capsys):
    from jax_offload.generate import main

    # No compilation cache: in this process it would stay on for the tests after this one.
    argv = ["--model", str(model_dirs["qwen3"]), "--prompt", "w1 w2", "--tensor-parallel-size", "3",
            "--compilation-cache-dir", ""]
    assert main(argv) == 2
    assert "tensor_parallel_size 3 does not split" in capsys.readouterr().err
