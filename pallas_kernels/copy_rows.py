"""Copy chosen rows of one array into chosen rows of another, reading only those rows.

`copy_rows(dst, src, src_rows, dst_rows)` writes src[src_rows[i]] to dst[dst_rows[i]] for every i with
dst_rows[i] < len(dst), in one launch of one program per i; entries past dst's rows are skipped without reading
their source row. `src` may live in pinned host memory (memory kind "pinned_host") when the call runs on a GPU
inside `jax.jit`: each program's load then crosses PCIe for its own row only, as the paged decode kernel reads a
pinned store's pages in place, and nothing gathers on the host. `dst` is updated in place (donate it to the
enclosing jit, or XLA copies it first). This is how the GPU cache of chosen pages (`jax_offload.sparse.page_cache`)
takes in the pages it lacks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import compiler_params, interpret_aware_jit, resolve_interpret


def _copy_rows_kernel(src_row_ref, dst_row_ref, *refs, num_dst_rows: int):
    # refs: the sources, the destinations as inputs (aliased to the outputs, never read), the outputs.
    leaves = len(refs) // 3
    sources, outputs = refs[:leaves], refs[2 * leaves:]
    src, dst = src_row_ref[()], dst_row_ref[()]

    @pl.when(dst < num_dst_rows)
    def _copy():
        for source, output in zip(sources, outputs):
            output[pl.ds(dst, 1), :] = source[pl.ds(src, 1), :]


def _copy_rows(dst, src, src_rows, dst_rows, *, interpret, num_warps):
    flat_dst = [d.reshape(d.shape[0], -1) for d in dst]
    flat_src = [s.reshape(s.shape[0], -1) for s in src]
    whole = [pl.BlockSpec(a.shape, lambda i: (0, 0)) for a in flat_src + flat_dst]
    out = pl.pallas_call(
        functools.partial(_copy_rows_kernel, num_dst_rows=dst[0].shape[0]),
        grid=(src_rows.shape[0],),
        in_specs=[pl.BlockSpec((None,), lambda i: (i,))] * 2 + whole,
        out_specs=whole[len(src):],
        out_shape=[jax.ShapeDtypeStruct(d.shape, d.dtype) for d in flat_dst],
        input_output_aliases={2 + len(src) + i: i for i in range(len(dst))},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="copy_rows",
    )(src_rows, dst_rows, *flat_src, *flat_dst)
    return [o.reshape(d.shape) for o, d in zip(out, dst)]


_copy_rows = interpret_aware_jit(_copy_rows, ("interpret", "num_warps"))


def copy_rows(dst, src, src_rows: jax.Array, dst_rows: jax.Array, *, interpret: bool | None = None,
              num_warps: int = 4):
    """dst with dst[dst_rows[i]] = src[src_rows[i]] for each i where dst_rows[i] < dst's rows (the others skipped,
    their source row not read).

    Args:
      dst, src: arrays or matching pytrees of arrays (the leaves of a stored KV form: values and their scales),
        row axis first; leaf j of src and of dst share a dtype and a row's shape, whose element count is a power
        of two (a Triton block).
      src_rows, dst_rows: int [n], the same n; a kept entry's src row must lie in [0, src's rows).
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      num_warps: Triton's warps per program (static).
    """
    dst_leaves, tree = jax.tree.flatten(dst)
    src_leaves = tree.flatten_up_to(src)
    for d, s in zip(dst_leaves, src_leaves):
        if d.dtype != s.dtype or d.shape[1:] != s.shape[1:]:
            raise ValueError(f"src leaf {s.dtype}{list(s.shape)} does not match dst leaf {d.dtype}{list(d.shape)}; "
                             "allowed: the same dtype and row shape")
        row = math.prod(d.shape[1:])
        if row & (row - 1):
            raise ValueError(f"a row of {row} elements ({list(d.shape[1:])}); allowed: a power of two")
    if src_rows.ndim != 1 or src_rows.shape != dst_rows.shape:
        raise ValueError(f"src_rows {list(src_rows.shape)} and dst_rows {list(dst_rows.shape)}; allowed: one "
                         "shape [n]")
    out = _copy_rows(dst_leaves, src_leaves, src_rows.astype(jnp.int32), dst_rows.astype(jnp.int32),
                     interpret=resolve_interpret(interpret), num_warps=num_warps)
    return tree.unflatten(out)
