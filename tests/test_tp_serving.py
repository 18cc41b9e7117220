"""Tensor parallelism under continuous batching, on 4 virtual CPU devices (`tp_check.py serving`): several prompts
together at TP=2 and a preempted run give TP=1's greedy tokens one at a time, and the layer steps' only
collectives are the row-parallel all-reduces. A file of its own so that xdist runs it beside `test_tp.py`'s
logits run (each subprocess takes minutes).
"""
from __future__ import annotations

from test_tp import MODELS, PROMPT_SEED, device_runs, model_dirs  # noqa: F401 (model_dirs: the fixture)


def test_tp_serving_on_virtual_devices_equals_tp1(model_dirs):  # noqa: F811
    runs = device_runs("serving", model_dirs)
    _check_batch_equals_one_at_a_time(runs)
    _check_preemption(runs)
    _check_only_all_reduce(runs)


def _check_batch_equals_one_at_a_time(runs):
    """Several prompts at TP=2 run together (continuous batching), over the split paged pool in GPU memory and
    over the split host store offloaded."""
    rows = [r for r in runs if r.get("case") == "batched"]
    assert len(rows) == 2 * len(MODELS)
    for r in rows:
        case = (f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, {r['mode']}, 4 prompts together, prompt seed "
                f"{PROMPT_SEED}+i")
        assert r["tokens"] == r["ref_tokens"], f"{case}: greedy tokens differ from TP=1 one at a time"
        assert r["largest_batch"] == 4, case


def _check_preemption(runs):
    """At TP=2 in GPU memory a 20-block pool forces preemption: each device's share of a request's blocks goes to
    host memory and back, or with no swap space the request is recomputed; the tokens are TP=1's."""
    (r,) = [r for r in runs if r.get("case") == "preempted"]
    for name, counter in (("swap", "swap_outs"), ("recompute", "recomputes")):
        case = f"{r['model']} (model seed {MODELS[r['model']]}), TP=2, {name}, prompt seed {PROMPT_SEED}+i"
        assert r[name][counter] > 0, f"{case}: no request was preempted that way"
        assert r[name]["tokens"] == r["ref_tokens"], f"{case}: greedy tokens differ from TP=1 one at a time"


def _check_only_all_reduce(runs):
    """XLA's collectives are the two all-reduces of the row-parallel wo and w_down per layer; attention is local."""
    steps = next(r["steps"] for r in runs if r.get("case") == "collectives")
    layer_ends = {"all-reduce": 2, "all-gather": 0, "all-to-all": 0, "collective-permute": 0, "reduce-scatter": 0}
    for name in ("prefill_layer_in_device", "decode_layer_in_device", "chunk_end"):
        assert steps[name] == layer_ends, name
    for name in ("chunk_begin", "attend_blocks"):
        assert sum(steps[name].values()) == 0, f"{name}: {steps[name]}"
