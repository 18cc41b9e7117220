"""What a jitted program's launch costs the host, by its number of arguments and of kernels (issue 63: the 128K
batch-of-one step is the host's dispatch, and neither fewer programs nor 13% fewer kernels a program moved it).

Each program is called REPEATS (5) times CALLS (200) times in a row, each call taking the previous call's result
(a new buffer every call, as a decode step's hidden state), blocking only at the end of a loop: the host's time per
call, median of the loops (min-max). Programs, each for N in SIZES (10, 100, 300):
- `args`: N small arrays in, one fusion adds them (many arguments, one kernel);
- `kernels`: one array in, N elementwise steps kept apart by optimization barriers (one argument, N kernels);
- `both`: N arrays in, each added in a kernel of its own (N arguments, N kernels);
- by kind of kernel, one array in, N steps of it (what a sparse decode layer's graph holds besides fusions):
  `pallas` a Pallas (Triton) call, `sort` a top-k, `loop` a 4-step while loop, `scatter` a row scatter.
- `steps_looped`: the `kernels` program's N kernels as the body of a `fori_loop` of LOOP_STEPS (8) steps in one
  program, its host time given per step (what a decode of several steps a launch would cost the host: does XLA keep
  the loop in its CUDA graph, or launch the body step by step from the host?). Run once more with
  `XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE` to let XLA's command buffers take while loops.
Beside each host time, the program's GPU time a call (`gpu_span_ms`, median of 5 traced calls): where it is as long
as the host's, the loop waited for the device and the host figure is an upper bound.
Writes probe_launch_cost.json under $OUT.

    python bench/probes/probe_launch_cost.py
"""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from common import gpu_span_ms, probe_output, run_metadata, stats  # noqa: E402
from pallas_kernels._common import resolve_interpret  # noqa: E402

SIZES = [int(n) for n in os.environ.get("SIZES", "10,100,300").split(",")]
CALLS, REPEATS = int(os.environ.get("CALLS", 200)), int(os.environ.get("REPEATS", 5))
LOOP_STEPS = 8


def many_args(y, *xs):
    return y + sum(xs)


def many_kernels(y, n: int):
    for _ in range(n):
        y = jax.lax.optimization_barrier(y * 1.0001 + 1.0)
    return y


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def pallas_step(y):
    return pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
                          interpret=resolve_interpret(None))(y)


def sort_step(y):
    return y + jax.lax.top_k(y, 8)[0][0]


def loop_step(y):
    return jax.lax.fori_loop(0, 4, lambda i, y: y * 1.0001 + i, y, unroll=False)


def scatter_step(y):
    rows = jnp.arange(0, y.shape[0], 64)
    return y.at[rows].add(1.0)


STEPS = {"pallas": pallas_step, "sort": sort_step, "loop": loop_step, "scatter": scatter_step}


def chain(step, n: int):
    def run(y):
        for _ in range(n):
            y = jax.lax.optimization_barrier(step(y))
        return y
    return jax.jit(run)


def args_and_kernels(y, *xs):
    for x in xs:
        y = jax.lax.optimization_barrier(y + x)
    return y


def steps_looped(n: int):
    return jax.jit(lambda y: jax.lax.fori_loop(0, LOOP_STEPS, lambda i, y: many_kernels(y, n), y))


def per_call_ms(fn, y, *xs) -> dict:
    """The host's time per call, CALLS calls chained, median over REPEATS loops (after one to compile)."""
    jax.block_until_ready(fn(y, *xs))
    loops = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = y
        for _ in range(CALLS):
            out = fn(out, *xs)
        dispatched = time.perf_counter() - start
        jax.block_until_ready(out)
        loops.append(dispatched * 1e3 / CALLS)
    return stats(loops)


def main():
    y = jnp.zeros(4096, jnp.float32)
    result = {**run_metadata(), "calls": CALLS, "repeats": REPEATS, "loop_steps": LOOP_STEPS,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "host_ms_per_call": {}}
    for n in SIZES:
        xs = [jnp.full(4096, i, jnp.float32) for i in range(n)]
        kernels = jax.jit(many_kernels, static_argnums=1)
        programs = {"args": (jax.jit(many_args), xs), "kernels": (lambda out, *_: kernels(out, n), []),
                    "both": (jax.jit(args_and_kernels), xs),
                    **{kind: (chain(step, n), []) for kind, step in STEPS.items()},
                    "steps_looped": (steps_looped(n), [])}
        rows = {}
        for name, (fn, extra) in programs.items():
            rows[name] = per_call_ms(fn, y, *extra)
            if jax.default_backend() == "gpu":
                rows[name]["gpu_ms_per_call"] = stats(gpu_span_ms(lambda fn=fn, extra=extra: fn(y, *extra), 5))
        looped = rows["steps_looped"]
        looped["host_ms_per_step"] = {k: looped[k] / LOOP_STEPS for k in ("median", "min", "max")}
        result["host_ms_per_call"][n] = rows
        print(n, json.dumps(rows), flush=True)
    probe_output("probe_launch_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
