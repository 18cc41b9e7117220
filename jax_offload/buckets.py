"""Length buckets: padding lengths to a few sizes makes jit-compiled shapes repeat across requests."""
from __future__ import annotations


def _bucket(n: int, smallest: int, linear_step: int) -> int:
    # Powers of two up to `linear_step`, then multiples of it: at most 2x padding for short inputs,
    # at most one step for long ones.
    size = smallest
    while size < n and size < linear_step:
        size *= 2
    if size >= n:
        return size
    return -(-n // linear_step) * linear_step


def prompt_bucket(n: int) -> int:
    """Padded length of an n-token prompt run in one piece."""
    return _bucket(n, 16, 1024)


def cache_bucket(n: int) -> int:
    """Length of an in-GPU KV cache that must hold n tokens."""
    return _bucket(n, 256, 4096)


def key_span_bucket(n: int) -> int:
    """Keys an estimate over the first n of a buffer reads: powers of two up to 128K, then multiples of 128K (a
    1M-token prompt's chunks compile a dozen spans, and read on average about half the buffer)."""
    return _bucket(n, 256, 131072)


# The most layers one program runs (`layer_group_size`).
LAYER_GROUP_MAX = 8


def layer_group_size(num_layers: int) -> int:
    """Consecutive layers one program runs: the largest divisor of num_layers up to LAYER_GROUP_MAX. Each program
    launch costs the host about 0.4-0.5 ms on an H200 besides its kernels (a graph update for new buffers), so a
    program per layer made a short prompt's prefill host-bound (15.5 ms for Qwen3-0.6B's 28 layers at 560 tokens,
    5.6 ms as one program: bench/results/runs/h200_dispatch/); a program over every layer would compile for each
    shape as long as the whole model does. Equal groups share one compiled program."""
    return max(g for g in range(1, min(num_layers, LAYER_GROUP_MAX) + 1) if num_layers % g == 0)
