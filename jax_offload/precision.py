"""How the engine's steps are compiled: every value is rounded to its dtype where the program says so.

XLA may by default keep bfloat16 intermediates in float32 inside a fusion ("excess precision"). Which
intermediates stay wide then depends on how a program is cut into jitted calls, so the offloaded engine
(several calls per layer) and the in-GPU engine (one call per layer) would round differently and drift
apart in bfloat16. With excess precision off, each op rounds as written, the same in every mode, and
as PyTorch does op by op.
"""
from __future__ import annotations

from collections.abc import Callable

import jax

STRICT_PRECISION = {"xla_allow_excess_precision": False}


def step_jit(fun: Callable | None = None, **jit_kwargs):
    """`jax.jit` with the engine's precision rule; usable as `functools.partial(step_jit, ...)`."""
    if fun is None:
        return lambda f: step_jit(f, **jit_kwargs)
    return jax.jit(fun, compiler_options=STRICT_PRECISION, **jit_kwargs)
