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
