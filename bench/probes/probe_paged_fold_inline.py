"""Probe: can the batch-invariant paged decode fold its splits in the attention kernel where one program already walks
all of a (sequence, KV head)'s splits? In a workload's decode step (256 sequences x 8 KV heads) `paged_decode_state`
launches one program per (sequence, KV head) (`num_programs` = 1), which writes each split's float32 (o, lse) to
memory; `fold_splits` then reads them back and folds them in key order in a second kernel (on 11-30 0.45 ms of a
256-row 8B step, 32 launches). Here one kernel does both: after each split's `finish_online_softmax` it folds (o,
lse) into the running state with the fold kernel's operations, and writes only the state.

It reports, per shape, the bits of the fused kernel against the library (one program a (sequence, KV head) with the
fold kernel, and 8 programs a (sequence, KV head), split-parallel) and, on a GPU, the time of each (median of 20
timed loops of 10 calls, min-max, us a call). The fused kernel may replace the library's path only if every bit is
the same on the GPU: alone (split-parallel), batched (one program) and offloaded (`decode_state` + `fold_splits`)
must keep one answer. On a CPU it runs small shapes in the interpreter and only checks the bits.

    python bench/probes/probe_paged_fold_inline.py --out $OUT/paged_fold_inline.json
"""
import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from common import run_metadata  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from pallas_kernels._common import (LOG2E, MIN_BLOCK, NEG_INF, cdiv, check_sm_scale, compiler_params,  # noqa: E402
                                    dot_precision, next_pow2)
from pallas_kernels.decode import default_decode_config  # noqa: E402
from pallas_kernels.fold import _fold_one_split  # noqa: E402
from pallas_kernels.paged_decode import _attend_paged_split  # noqa: E402
from pallas_kernels.state import AttentionState  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
# (batch, Hq, Hkv, D, page size, split, longest sequence): the 8B and Qwen3-0.6B shapes at a workload's batch; on a
# CPU, small ones.
GPU_SHAPES = [(256, 32, 8, 128, 256, 1024, 2048), (256, 16, 8, 128, 256, 1024, 2048), (64, 32, 8, 128, 256, 1024, 2048),
              (256, 32, 8, 128, 256, 1024, 600)]
CPU_SHAPES = [(3, 4, 2, 32, 64, 64, 300), (5, 8, 2, 32, 32, 64, 200)]
LOOPS, CALLS = 20, 10


def fused_kernel(seqlen_ref, bt_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, acc_out, m_out, l_out, *,
                 scale_log2, page_size, block_k, split_len, group, precision):
    """The library's split attention (`_attend_paged_split`) and fold (`_fold_one_split`), one after the other for
    each of the program's splits."""
    seq_len = seqlen_ref[()]
    block_h = q_ref.shape[0]
    row_ok = jnp.arange(block_h) < group
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)
    state = (plgpu.load(acc_ref, mask=row_ok[:, None], other=0.0),
             plgpu.load(m_ref, mask=row_ok[:, None], other=NEG_INF),
             plgpu.load(l_ref, mask=row_ok[:, None], other=0.0))

    def one_split(split, state):
        o, lse = _attend_paged_split(q, seq_len, split * split_len, bt_ref, k_ref, v_ref, None, None,
                                     scale_log2=scale_log2, page_size=page_size, page_stride=page_size, v_offset=0,
                                     block_k=block_k, split_len=split_len, precision=precision)
        return _fold_one_split(state, o, lse[:, None], True)

    acc, m, l = lax.fori_loop(0, cdiv(seq_len, split_len), one_split, state)
    plgpu.store(acc_out, acc, mask=row_ok[:, None])
    plgpu.store(m_out, m, mask=row_ok[:, None])
    plgpu.store(l_out, l, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("split_len",))
def fused(q, k_pages, v_pages, tables, seq_lens, state, *, split_len):
    batch, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    group = hq // hkv
    block_h = max(MIN_BLOCK, next_pow2(group))
    cfg = default_decode_config(q.dtype)
    rows = num_pages * page_size
    kv_spec = pl.BlockSpec((rows, None, d), lambda bh: (0, bh % hkv, 0))
    row_spec = pl.BlockSpec((None, None, block_h, d), lambda bh: (bh // hkv, bh % hkv, 0, 0))
    stat_spec = pl.BlockSpec((None, None, block_h, 1), lambda bh: (bh // hkv, bh % hkv, 0, 0))
    acc, m, l = pl.pallas_call(
        functools.partial(fused_kernel, scale_log2=check_sm_scale(None, d) * LOG2E, page_size=page_size,
                          block_k=math.gcd(cfg["block_k"], split_len, page_size), split_len=split_len, group=group,
                          precision=dot_precision(q.dtype)),
        grid=(batch * hkv,),
        in_specs=[pl.BlockSpec((None,), lambda bh: (bh // hkv,)),
                  pl.BlockSpec((None, tables.shape[1]), lambda bh: (bh // hkv, 0)),
                  row_spec, kv_spec, kv_spec, row_spec, stat_spec, stat_spec],
        out_specs=[row_spec, stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, hkv, group, d), jnp.float32),
                   jax.ShapeDtypeStruct((batch, hkv, group, 1), jnp.float32),
                   jax.ShapeDtypeStruct((batch, hkv, group, 1), jnp.float32)],
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=not ON_GPU,
        name="paged_decode_fold_inline",
    )(seq_lens, tables, q.reshape(batch, hkv, group, d), k_pages.reshape(rows, hkv, d),
      v_pages.reshape(rows, hkv, d), state.acc.reshape(batch, hkv, group, d), state.m.reshape(batch, hkv, group, 1),
      state.l.reshape(batch, hkv, group, 1))
    return AttentionState(acc.reshape(batch, 1, hq, d), m.reshape(batch, hq, 1), l.reshape(batch, hq, 1))


def inputs(seed, batch, hq, hkv, d, page, longest):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, longest + 1, batch).astype(np.int32)
    pages = -(-lens // page)
    order = rng.permutation(int(pages.sum()))
    tables = np.zeros((batch, int(pages.max())), np.int32)
    at = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[at:at + n]
        at += n
    dtype = jnp.bfloat16 if ON_GPU else jnp.float32
    k = jnp.asarray(rng.standard_normal((len(order), page, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((len(order), page, hkv, d)), dtype)
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens)


def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    if not ON_GPU:
        return {}
    times = []
    for _ in range(LOOPS):
        start = time.perf_counter()
        for _ in range(CALLS):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return {"median_us": float(np.median(times)), "min_us": min(times), "max_us": max(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    rows = []
    for seed, (batch, hq, hkv, d, page, split, longest) in enumerate(GPU_SHAPES if ON_GPU else CPU_SHAPES):
        q, k, v, tables, lens = inputs(seed, batch, hq, hkv, d, page, longest)
        empty = pk.empty_state(batch, 1, hq, d)
        ways = {
            "library, one program a (sequence, KV head)": jax.jit(functools.partial(
                pk.paged_decode_state, split_len=split, num_programs=1)),
            "library, 8 programs a (sequence, KV head)": jax.jit(functools.partial(
                pk.paged_decode_state, split_len=split, num_programs=8)),
            "fused": functools.partial(fused, split_len=split),
        }
        results = {}
        for name, fn in ways.items():
            results[name] = (fn(q, k, v, tables, lens, empty), timed(fn, q, k, v, tables, lens, empty))
        reference = results["library, one program a (sequence, KV head)"][0]
        for name, (state, t) in results.items():
            row = dict(batch=batch, hq=hq, hkv=hkv, d=d, page=page, split=split, longest=longest, seed=seed, way=name,
                       bits_equal_library=all(bool(jnp.array_equal(x, y)) for x, y in zip(state, reference)), **t)
            rows.append(row)
            print(json.dumps(row), flush=True)
        a.out.write_text(json.dumps({"meta": run_metadata(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
