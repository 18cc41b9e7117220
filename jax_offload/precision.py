"""How the engine's steps are compiled: every value is rounded to its dtype where the program says so.

XLA may by default keep bfloat16 intermediates in float32 inside a fusion ("excess precision"). Which
intermediates stay wide then depends on how a program is cut into jitted calls, so the offloaded engine
(several calls per layer) and the in-GPU engine (one call per layer) would round differently and drift
apart in bfloat16. With excess precision off, each op rounds as written, the same in every mode, and
as PyTorch does op by op. Sums whose bits must not depend on a batch are fixed trees (`sum_last_axis`).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

STRICT_PRECISION = {"xla_allow_excess_precision": False}


def step_jit(fun: Callable | None = None, **jit_kwargs):
    """`jax.jit` with the engine's precision rule; usable as `functools.partial(step_jit, ...)`."""
    if fun is None:
        return lambda f: step_jit(f, **jit_kwargs)
    return jax.jit(fun, compiler_options=STRICT_PRECISION, **jit_kwargs)


# XLA fuses a whole halving tree into loops in which one GPU thread sums a row's columns one after another: with
# thousands of rows that leaves most of the GPU idle (a 16K-token chunk's RMSNorm of 4096 columns took 1.5 ms on an
# H100). Materialising the [rows, 64] partial sums splits it into two parallel fusions; the additions stay the same.
_TREE_CUT_WIDTH = 64
_TREE_CUT_MIN_ROWS = 1024


def sum_last_axis(x: jax.Array) -> jax.Array:
    """Sum over the last axis by pairwise halving: the same additions in the same order however many rows
    are computed together (XLA's CPU reductions change their order with the row count), so a token's
    result does not depend on the chunk or batch it is computed in. Zeros padded at the end add nothing, so
    neither does it depend on how far a row is padded (e.g. page slots past a request's pages). -> [..., 1]"""
    size = 1 << (x.shape[-1] - 1).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])
    cut = x.size // size >= _TREE_CUT_MIN_ROWS
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
        if cut and half == _TREE_CUT_WIDTH:
            x = jax.lax.optimization_barrier(x)
    return x
