"""A batch-invariant matmul: row i of x @ w has the same bits whatever the other rows and their count.

cuBLAS picks its algorithm (tiling, split-K, reduction order) from the shape, so on a GPU row 0 of `x[:M] @ w` changes
with M: a request's tokens then depend on which requests share its step (by default 5 of 16 prompts kept their tokens
batched on the H200, `bench/results/runs/h200_batch_invariance/`). Here every output element is one float32 sum of
`block_k`-wide tile products in ascending K order, rounded once to the output dtype: the products of each `K_CHUNK` keys
summed from zero, then the chunks' sums added in ascending order; `block_k` and the chunks depend on K alone. With
`one_pass` all of K is one chunk: the order a prompt's tokens take (the engine's prefill), where a tile holding one
float32 sum instead of two runs near cuBLAS's speed; generated tokens keep the chunks, which a one-row matmul against a
narrow weight needs to keep the weight in flight (a program a chunk: `split_k`; a token is computed in the same phase
however its request runs, so each order only has to hold within its phase; a generated token recomputed by a prefill
after a preemption is the exception). Weights of `ONE_PASS_N` columns or more (w_gate_up, LM heads) have programs enough
over their columns at one row, so they sum all of K in one pass in both phases: a decode batch's tile then holds one
float32 sum too. A deep K (`GROUPED_CHUNKS` chunks or more, an even count: the 8B's w_down) adds its chunks' sums in two
groups, each group's in ascending order, then the two groups' sums: a decode batch's program can then cover one group,
twice the programs over a narrow weight. The tiles over rows and columns (`block_m`, `block_n`) only decide which
program computes an element, and `k_unroll` how many K tiles a loop step loads, so they are picked per call for speed:
wide tiles for prefill, narrow ones for decode batches, where the weight must be read by many programs at once, each
with enough of it in flight, to reach HBM speed; `split_k` whether each chunk of K is a program of its own (a decode
batch's few row tiles and narrow weights give too few programs otherwise), its float32 sum added to the others' after.
Their bits are the same (tested on the H200 with `bench/probes/probe_matmul.py`, on an H100 in
`bench/results/runs/h100_matmul_unroll/`, and in interpret mode by tests/test_batch_invariance.py).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (MIN_BLOCK, compiler_params, dot_precision, hopper_matmul_allowed,
                                    interpret_aware_jit, on_hopper, resolve_interpret)

BLOCK_K = 64
# Keys of K whose tile products are summed from zero before their sum joins the running total (chunks in ascending
# order). A K that is not a multiple of it is one chunk.
K_CHUNK = 1024
# Weights at least this wide sum K in one pass for every token: even one row gives them programs enough over their
# columns, each reading all of K (`default_matmul_config`), so no order of theirs needs K in chunks.
ONE_PASS_N = 16384
# A K of at least this many chunks, an even count, adds them in two groups (`k_groups_for`).
GROUPED_CHUNKS = 8


def block_k_for(k: int) -> int:
    """Keys of the K axis per tile product: the fixed reduction step of a weight with K rows."""
    if k % MIN_BLOCK:
        raise ValueError(f"K={k}; allowed: a multiple of {MIN_BLOCK}")
    return next(b for b in (BLOCK_K, 32, 16) if k % b == 0)


def chunk_len_for(k: int, one_pass: bool = False) -> int:
    """Keys of K summed from zero before being added to the other chunks' sums: K_CHUNK, or all of K (`one_pass`,
    or a K that K_CHUNK does not divide)."""
    return K_CHUNK if k % K_CHUNK == 0 and not one_pass else k


def k_groups_for(k: int, one_pass: bool = False) -> int:
    """Groups of consecutive chunks K's sum falls in: each group's chunk sums added in ascending order (the first
    its start), then the groups' sums in order. Two where K has GROUPED_CHUNKS chunks or more, an even count (a
    decode batch's programs then cover one group each: twice the programs of 128 rows over the 8B's w_down, whose
    CTAs over all of K filled half of the SMs at 128 rows); else one."""
    chunks = k // chunk_len_for(k, one_pass)
    return 2 if chunks >= GROUPED_CHUNKS and chunks % 2 == 0 else 1


def grouped_total(chunk_sums: list, groups: int):
    """The sum of `chunk_sums` (float32, in K's order) in `groups` groups of consecutive ones: each group's added in
    order, then the groups' sums in order: the order `k_groups_for` defines."""
    per_group = len(chunk_sums) // groups
    return functools.reduce(operator.add, [functools.reduce(operator.add, chunk_sums[g * per_group:(g + 1) * per_group])
                                           for g in range(groups)])


def sums_in_one_pass(n: int, one_pass: bool) -> bool:
    """Whether a matmul against a weight of `n` columns sums K in one pass: asked for (a prompt's tokens), or a weight
    of ONE_PASS_N columns or more (every token)."""
    return one_pass or n >= ONE_PASS_N


def default_matmul_config(m: int, k: int, n: int, one_pass: bool = False) -> dict[str, int]:
    """Launch parameters by row count and weight shape, the fastest measured for the Llama-3.1-8B and Qwen3-0.6B
    projections (bench/probes/probe_matmul.h200.json; one row: bench/results/runs/h200_matmul_decode/); any choice
    gives the same bits."""
    one_pass = sums_in_one_pass(n, one_pass)
    if m <= 16:
        # One row tile: the weight's read sets the time. Wide weights (w_gate_up, the LM head) have programs enough
        # over their columns, each reading all of K; the others take a program per 1,024 keys of K as well (split_k),
        # or too few programs keep too little of the weight in flight (bench/results/runs/h200_matmul_decode/).
        if n >= ONE_PASS_N:
            cfg = dict(block_m=16, block_n=128, k_unroll=2 if n >= 65536 else 1, split_k=False, num_warps=4,
                       num_stages=4)
        else:
            cfg = dict(block_m=16, block_n=64, k_unroll=1, split_k=True, num_warps=4,
                       num_stages=4 if n > 4096 or k >= 8192 else 6)
    elif m <= 512 and (k * n < 16 * 2**20 or n >= 65536):
        # Qwen3-0.6B's projections; LM heads (probe_matmul.h200.json).
        cfg = dict(block_m=64, block_n=64, num_warps=4, num_stages=4) if n < 65536 else \
            dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
    elif m <= 512:
        # The 8B projections in a batched decode step (runs/h200_invariant_price/prefill_tiles/): 64-row tiles of 128
        # columns; up to 128 rows the narrower weights take a program per 1,024 keys too, as at one row.
        cfg = dict(block_m=64, block_n=128, split_k=m <= 128 and n < ONE_PASS_N, num_warps=4, num_stages=4)
    else:
        # 128 x 256 tiles were the fastest over all of K; with K in chunks a tile keeps two float32 sums live (the
        # chunk's and the total), 256 registers a thread at 8 warps (the 8B 32K prefill took 2.10x the default's), so
        # chunked K takes 128 x 128 tiles at 4 stages (1.40x; the matmuls alone 1.47x cuBLAS's time:
        # runs/h200_invariant_price/, "Batched decode and prefill").
        wide = k * n >= 16 * 2**20 and chunk_len_for(k, one_pass) == k
        cfg = dict(block_m=128, block_n=256 if wide else 128, num_warps=8, num_stages=3 if wide else 4)
    cfg["block_n"] = next(b for b in (256, 128, 64, 32, 16) if b <= cfg["block_n"] and n % b == 0)
    tiles = chunk_len_for(k, one_pass) // block_k_for(k)
    cfg["k_unroll"] = next(u for u in (cfg.get("k_unroll", 1), 2, 1) if tiles % u == 0)
    cfg["split_k"] = cfg.get("split_k", False) and chunk_len_for(k, one_pass) < k
    return cfg


def wgmma_suits(m: int, n: int, k: int) -> bool:
    """Whether `m` rows against a [k, n] weight take the warpgroup-MMA form on Hopper: prefill sizes, decode batches of
    64 rows or more against wide weights, of 128 or more against large ones (k * n >= 24 Mi: the 8B's wqkv and w_down,
    23.6 and 63.2 us at 128 rows against the Triton form's 31.6 and 65.2) and of 256 or more against deep ones (the
    8B's four projections at 256 rows), and of 64 or more against a K whose chunks add in groups (the 8B's w_down at 64
    rows: 40.0 us against the Triton form's 46.1 and cuBLAS's 41.0: runs/h200_invariant_price/price_2026_12_01/
    w_down_groups/). The Triton form keeps small weights at decode sizes, where it is the faster (Qwen3-0.6B's at 256
    rows, the 8B's wo at 128: runs/h200_invariant_price/price_2026_11_30/matmul/)."""
    return (m > 512 or (m >= 64 and (n >= 16384 or k_groups_for(k) > 1)) or (m >= 128 and k * n >= 24 * 2**20)
            or (m >= 256 and k >= 4096))


def _matmul_kernel(x_ref, w_ref, o_ref, *, block_k: int, k_unroll: int, chunk: int, groups: int, transpose_w: bool,
                   precision, num_rows: int):
    # Rows past x's `num_rows` (a row tile wider than a decode batch) load as zeros and are not stored: no padded copy
    # of x is made (a pad kernel per matmul, ~0.19 ms of an 8B decode step). Rows do not mix, so a row's bits are
    # the same either way.
    block_m = x_ref.shape[0]
    row_ok = None
    if num_rows % block_m:
        row_ok = (pl.program_id(0) * block_m + jnp.arange(block_m) < num_rows)[:, None]

    # k_unroll tile products per loop step, in ascending order: the same sequence of products as one per step (so
    # the same bits), with k_unroll times the bytes in each software-pipeline stage.
    def body(t, acc):
        for u in range(k_unroll):
            cols = pl.ds(pl.multiple_of((t * k_unroll + u) * block_k, block_k), block_k)
            w = plgpu.load(w_ref.at[:, cols] if transpose_w else w_ref.at[cols, :])
            x = plgpu.load(x_ref.at[:, cols]) if row_ok is None else plgpu.load(x_ref.at[:, cols], mask=row_ok,
                                                                                 other=0)
            acc = acc + plgpu.dot(x, w, trans_b=transpose_w, precision=precision)
        return acc

    steps = chunk // (block_k * k_unroll)  # loop steps a chunk

    def chunk_sum(c):
        return lax.fori_loop(c * steps, (c + 1) * steps, body, jnp.zeros(o_ref.shape[-2:], jnp.float32))

    def chunks_sum(first, count: int):
        # The first chunk's sum is the start (not 0 + it: the same bits for one chunk).
        total = chunk_sum(first)
        if count > 1:
            total = lax.fori_loop(first + 1, first + count, lambda c, total: total + chunk_sum(c), total)
        return total

    per_group = x_ref.shape[1] // chunk // groups
    total = chunks_sum(0, per_group)
    if groups > 1:
        total = lax.fori_loop(1, groups, lambda g, total: total + chunks_sum(g * per_group, per_group), total)
    if row_ok is None:
        o_ref[...] = total.astype(o_ref.dtype)
    else:
        plgpu.store(o_ref, total.astype(o_ref.dtype), mask=row_ok)


def _matmul(x, w, *, transpose_w, one_pass, out_dtype, interpret, block_m, block_n, k_unroll, split_k, num_warps,
            num_stages):
    m, k = x.shape
    n = w.shape[0] if transpose_w else w.shape[1]
    chunk = chunk_len_for(k, one_pass)
    groups = k_groups_for(k, one_pass)
    # One program per output tile over all of K, or (split_k) one per output tile and chunk of K.
    span, chunks = (chunk, k // chunk) if split_k else (k, 1)
    w_spec = pl.BlockSpec((block_n, span), lambda i, j, c: (j, c)) if transpose_w \
        else pl.BlockSpec((span, block_n), lambda i, j, c: (c, j))
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=block_k_for(k), k_unroll=k_unroll, chunk=chunk,
                          groups=1 if split_k else groups, transpose_w=transpose_w, precision=dot_precision(x.dtype),
                          num_rows=m),
        grid=(-(-m // block_m), n // block_n, chunks),
        in_specs=[pl.BlockSpec((block_m, span), lambda i, j, c: (i, c)), w_spec],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, c: (c, i, j)),
        out_shape=jax.ShapeDtypeStruct((chunks, m, n), jnp.float32 if split_k else out_dtype),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="matmul",
    )(x, w)
    # The chunks' sums added in the one-program form's order.
    return grouped_total(list(out), groups if split_k else 1).astype(out_dtype)


_matmul = interpret_aware_jit(_matmul, ("transpose_w", "one_pass", "out_dtype", "interpret", "block_m", "block_n",
                                        "k_unroll", "split_k", "num_warps", "num_stages"))


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, one_pass: bool = False, out_dtype=None,
           interpret: bool | None = None, block_m: int | None = None, block_n: int | None = None,
           k_unroll: int | None = None, split_k: bool | None = None, num_warps: int | None = None,
           num_stages: int | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in `out_dtype` (default x's), each row's bits independent of the rows
    computed with it.

    Args:
      x: [..., K]; w: [K, N] of x's dtype, K and N multiples of 16 ([N, K] with transpose_w: a tied embedding
        table as the LM head, read in place).
      one_pass: all of K summed as one chunk (prompt tokens) instead of in K_CHUNK-key chunks (generated tokens):
        another order, so other bits. Weights of ONE_PASS_N columns or more sum in one pass either way.
      interpret: None picks Triton on a GPU backend and interpret mode elsewhere.
      block_m, block_n, k_unroll, split_k, num_warps, num_stages: launch parameters (powers of two, block_n
        dividing N, k_unroll the K tiles loaded per loop step, dividing a chunk's tile count; split_k a program per
        chunk of K; default `default_matmul_config`); they change the speed, not the bits.

    On Hopper (unless JAX_OFFLOAD_HOPPER_MATMUL=0), untransposed bf16/f16 calls at the sizes `wgmma_suits` names,
    with no launch parameter given, run the warpgroup-MMA form (`mgpu_matmul`), the same sums.
    """
    k_axis = 1 if transpose_w else 0
    if w.ndim != 2 or x.shape[-1] != w.shape[k_axis]:
        raise ValueError(f"x has shape {x.shape} and w {w.shape}; allowed: x [..., K] and w "
                         f"{'[N, K]' if transpose_w else '[K, N]'}")
    if x.dtype != w.dtype:
        raise ValueError(f"x has dtype {x.dtype} and w {w.dtype}; allowed: one dtype")
    rows = x.reshape(-1, x.shape[-1])
    n = w.shape[1 - k_axis]
    one_pass = sums_in_one_pass(n, one_pass)
    launch = (block_m, block_n, k_unroll, split_k, num_warps, num_stages)
    if (hopper_matmul_allowed() and not resolve_interpret(interpret) and not transpose_w
            and all(p is None for p in launch) and x.dtype in (jnp.bfloat16, jnp.float16)
            and wgmma_suits(rows.shape[0], n, x.shape[-1]) and n % 128 == 0 and x.shape[-1] % BLOCK_K == 0
            and on_hopper()):
        from pallas_kernels.mgpu_matmul import default_tiles, mgpu_matmul  # it imports this module
        return mgpu_matmul(rows, w, one_pass=one_pass, out_dtype=out_dtype,
                           **default_tiles(rows.shape[0], n, one_pass, k_groups_for(x.shape[-1], one_pass))
                           ).reshape(*x.shape[:-1], n)
    cfg = default_matmul_config(rows.shape[0], x.shape[-1], n, one_pass)
    block_n = block_n or cfg["block_n"]
    if block_n < MIN_BLOCK or n % block_n:
        raise ValueError(f"block_n={block_n} for N={n}; allowed: a divisor of N, >= {MIN_BLOCK}")
    tiles = chunk_len_for(x.shape[-1], one_pass) // block_k_for(x.shape[-1])
    k_unroll = k_unroll or cfg["k_unroll"]
    if k_unroll < 1 or tiles % k_unroll:
        raise ValueError(f"k_unroll={k_unroll} for K={x.shape[-1]} ({tiles} tiles a chunk); allowed: a divisor of "
                         f"{tiles}")
    out = _matmul(rows, w, transpose_w=transpose_w, one_pass=one_pass, out_dtype=jnp.dtype(out_dtype or x.dtype),
                  interpret=resolve_interpret(interpret), block_m=block_m or cfg["block_m"], block_n=block_n,
                  k_unroll=k_unroll, split_k=cfg["split_k"] if split_k is None else split_k,
                  num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])
    return out.reshape(*x.shape[:-1], n)

