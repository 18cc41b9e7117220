"""The k largest entries of each row, returned as their positions in ascending order, in one Triton program a row.

`top_k_ascending(x, k)` equals `jnp.sort(jax.lax.top_k(x, k)[1], axis=-1)`: the same k positions (equal values: the
lower position first), sorted. XLA's GPU top-k of more than 16 entries is a sort of the whole row, and its positions
then need a second sort; sketch and Quest decode choose 256 of 8,192 pages per KV head and layer at 128K, and those
sorts took 45 us a layer on an H200 (this kernel: 21 us; bench/results/runs/h200_batch_of_one/README.md). Here each
program keeps its row in registers, finds the k-th largest value by a binary search over the bits of an
order-preserving integer key (32 rounds of compare-and-count), and writes the positions above it, then as many equal
to it as fit, lowest first, at their ranks (two prefix sums): no sort.

Rows longer than `ROW_MAX` run in two stages, as `jax_offload.sparse.quest.top_k` does: the top k of each
`ROW_MAX`-long chunk, then the top k of those (exact: an entry of the row's top k is in its chunk's, and ascending
positions keep equal values in position order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import compiler_params, interpret_aware_jit, next_pow2, resolve_interpret

# The longest row one program holds (32 values a thread at 8 warps).
ROW_MAX = 8192
_INT_MIN = -(2 ** 31)


def order_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (-0.0 as +0.0; NaN not allowed); int32 as it is."""
    if x.dtype == jnp.int32:
        return x
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _top_k_kernel(key_ref, o_ref, *, k: int):
    key = key_ref[...]
    index = lax.broadcasted_iota(jnp.int32, key.shape, 0)

    def at_least(t):  # keys >= t
        return jnp.sum((key >= t).astype(jnp.int32))

    # The k-th largest key, bit by bit from the sign down: the largest t with at least k keys >= t.
    t = jnp.where(at_least(jnp.int32(0)) >= k, jnp.int32(0), jnp.int32(_INT_MIN))
    for bit in range(30, -1, -1):
        candidate = t | jnp.int32(1 << bit)
        t = jnp.where(at_least(candidate) >= k, candidate, t)
    above, tied = key > t, key == t
    tied_i = tied.astype(jnp.int32)
    quota = k - jnp.sum(above.astype(jnp.int32))
    chosen = above | (tied & (jnp.cumsum(tied_i) - tied_i < quota))
    chosen_i = chosen.astype(jnp.int32)
    plgpu.store(o_ref.at[jnp.cumsum(chosen_i) - chosen_i], index, mask=chosen)


def _top_k_rows(x, *, k, interpret, num_warps):
    """One program a row; the keys padded to a power of two with int32's minimum (never chosen: k <= n, and ties
    go to the lower position)."""
    rows, n = x.shape
    width, out_width = next_pow2(n), next_pow2(k)
    key = jnp.pad(order_key(x), ((0, 0), (0, width - n)), constant_values=_INT_MIN)
    out = pl.pallas_call(
        functools.partial(_top_k_kernel, k=k),
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, width), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, out_width), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, out_width), jnp.int32),
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="top_k_ascending",
    )(key)
    return out[:, :k]


_top_k_rows = interpret_aware_jit(_top_k_rows, ("k", "interpret", "num_warps"))


def top_k_ascending(x: jax.Array, k: int, *, interpret: bool | None = None, num_warps: int = 8) -> jax.Array:
    """Positions of the k largest entries of each row of x [rows, n], ascending -> int32 [rows, k]; equal values:
    the lower position first. Equal to `jnp.sort(jax.lax.top_k(x, k)[1], axis=-1)`.

    Args:
      x: float32 (no NaN; -0.0 counts as +0.0) or int32 (no entry equal to int32's minimum), [rows, n], k <= n.
      k: static.
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      num_warps: Triton's warps per program (static).
    """
    if x.ndim != 2 or x.dtype not in (jnp.float32, jnp.int32):
        raise ValueError(f"x is {x.dtype}{list(x.shape)}; allowed: float32 or int32 [rows, n]")
    rows, n = x.shape
    if not 0 < k <= n:
        raise ValueError(f"k={k} for rows of {n}; allowed: 1 <= k <= {n}")
    interpret = resolve_interpret(interpret)
    if n <= ROW_MAX or n % ROW_MAX or 4 * k > ROW_MAX:
        return _top_k_rows(x, k=k, interpret=interpret, num_warps=num_warps)
    chunks = n // ROW_MAX
    first = _top_k_rows(x.reshape(rows * chunks, ROW_MAX), k=k, interpret=interpret, num_warps=num_warps)
    first = (first.reshape(rows, chunks, k) + (jnp.arange(chunks, dtype=jnp.int32) * ROW_MAX)[:, None]).reshape(
        rows, chunks * k)
    second = top_k_ascending(jnp.take_along_axis(x, first, axis=-1), k, interpret=interpret, num_warps=num_warps)
    return jnp.take_along_axis(first, second, axis=-1)
