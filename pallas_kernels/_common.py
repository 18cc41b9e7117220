"""Helpers shared by the kernels: backend choice, argument checks, block sizes."""

from __future__ import annotations

import functools
import inspect
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
# Triton's tensor-core dot needs every tile dimension to be at least 16.
MIN_BLOCK = 16
# An int4 key sketch's word rotated right by 4k bits and masked with this leaves its k-th pair of codes as two
# 16-bit subnormals (the layout: pallas_kernels/sketch.py's docstring).
INT4_PAIR_MASK = 0x80078007


# About one program per SM of an H100/H200 (132): on 64K keys, 16 splits x 8 KV heads ran at
# 0.94x the device copy bandwidth, against 0.81x for 64 splits (fewer, longer programs keep
# their loads pipelined for longer).
_TARGET_PROGRAMS = 128


def check_pallas_head_dim(d: int) -> None:
    """The Triton kernels' head dims: a power of two in [16, 256]."""
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(
            f"head_dim={d} is not supported by the Pallas kernel; allowed: a power of two in "
            "[16, 256] (use attention_with_lse_xla otherwise)")


def check_block_lists(kv_blocks, kv_block_counts, batch: int, hq: int, nqb: int) -> tuple[jax.Array, jax.Array]:
    """Block-sparse attention's lists, checked: -> int32 kv_blocks [B, Hq, nqb, max_blocks] and int32 counts
    [B, Hq, nqb] clamped to [0, max_blocks]."""
    kv_blocks = jnp.asarray(kv_blocks)
    counts = jnp.asarray(kv_block_counts)
    if kv_blocks.ndim != 4 or kv_blocks.shape[:3] != (batch, hq, nqb) or kv_blocks.shape[3] == 0:
        raise ValueError(f"kv_blocks has shape {kv_blocks.shape}; allowed: ({batch}, {hq}, {nqb}, "
                         "max_blocks) with max_blocks >= 1 ([B, Hq, ceil(Tq / block_size), ...])")
    if counts.shape != (batch, hq, nqb):
        raise ValueError(f"kv_block_counts has shape {counts.shape}; allowed: ({batch}, {hq}, {nqb})")
    for name, arr in (("kv_blocks", kv_blocks), ("kv_block_counts", counts)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} has dtype {arr.dtype}; allowed: an integer type")
    return kv_blocks.astype(jnp.int32), jnp.clip(counts.astype(jnp.int32), 0, kv_blocks.shape[3])


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: compile through Triton on a GPU backend, interpret anywhere else."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


@functools.cache
def _mosaic_load_takes_index() -> bool:
    from jax.experimental.pallas import mosaic_gpu
    idx = inspect.signature(mosaic_gpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


def mosaic_load(ref, **kwargs) -> jax.Array:
    """Mosaic GPU's `load` of a whole ref (index it with `.at` first): jax 0.10 wants the index as an argument of its
    own, jax 0.11 deprecates passing one."""
    from jax.experimental.pallas import mosaic_gpu
    return mosaic_gpu.load(ref, (), **kwargs) if _mosaic_load_takes_index() else mosaic_gpu.load(ref, **kwargs)


def mosaic_interpret_params():
    """Mosaic GPU's CPU interpreter (simulates warpgroups, barriers, TMA and wgmma): a test vehicle only. Public as
    plgpu.InterpretGPUParams from jax 0.11; private in 0.10."""
    from jax.experimental.pallas import mosaic_gpu
    params = getattr(mosaic_gpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def hopper_kernels_allowed() -> bool:
    """False when the environment sets JAX_OFFLOAD_HOPPER_ATTENTION=0, which keeps every attention-side kernel
    (prefill attention, block-sparse attention, sketch scores) on its Triton version."""
    return os.environ.get("JAX_OFFLOAD_HOPPER_ATTENTION", "1") != "0"


def hopper_matmul_allowed() -> bool:
    """False when the environment sets JAX_OFFLOAD_HOPPER_MATMUL=0, which keeps the batch-invariant matmul on its
    Triton form everywhere; by default it takes its warpgroup-MMA form (`mgpu_matmul.py`, the same bits) on Hopper at
    prefill sizes and wide or deep decode batches (`matmul.wgmma_suits`)."""
    return os.environ.get("JAX_OFFLOAD_HOPPER_MATMUL", "1") != "0"


def on_hopper() -> bool:
    """Whether the default device is a Hopper (sm_90) GPU, where the Mosaic GPU kernels run."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def fit_block(requested: int, length: int) -> int:
    """Largest power-of-two block <= `requested` that does not exceed the padded length.

    Triton tiles must be powers of two and at least 16 wide, so short sequences still get a
    16-row tile (the tail is masked).
    """
    if requested < MIN_BLOCK or requested & (requested - 1):
        raise ValueError(f"block size {requested}; allowed: a power of two >= {MIN_BLOCK}")
    return max(MIN_BLOCK, min(requested, next_pow2(length)))


def per_batch(value, batch: int, name: str) -> jax.Array:
    """Broadcast an int or int array (scalar or [batch]) to an int32 [batch] array.

    Works on traced values, so a new offset or length never triggers a recompile.
    """
    arr = jnp.asarray(value)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] not in (1, batch)):
        raise ValueError(f"{name} has shape {arr.shape}; allowed: a scalar or shape ({batch},)")
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} has dtype {arr.dtype}; allowed: an integer type")
    return jnp.broadcast_to(arr.astype(jnp.int32), (batch,))


def per_row(value, batch: int, rows: int, name: str = "kv_start") -> jax.Array | None:
    """None, or an int array of shape (batch, rows) as int32 (traced values welcome)."""
    if value is None:
        return None
    arr = jnp.asarray(value)
    if arr.shape != (batch, rows):
        raise ValueError(f"{name} has shape {arr.shape}; allowed: ({batch}, {rows}), one value per query row")
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} has dtype {arr.dtype}; allowed: an integer type")
    return arr.astype(jnp.int32)


def dot_precision(dtype) -> lax.Precision:
    """float32 dots must be exact float32 (Triton would use tf32 by default); others default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def cdiv(a, b):
    """Ceiling division of a non-negative traced int32 by a positive int, static or traced int32.

    `lax.div` truncates, which equals floor for the non-negative values used here and lowers
    to a single Triton op.
    """
    return lax.div(a + (b - 1), jnp.int32(b))


def fdiv(a, b: int):
    """Floor division of a non-negative traced int32 by a static positive int."""
    return lax.div(a, jnp.int32(b))


def check_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    """Default 1/sqrt(D); the kernels fold the scale into exp2 and need it positive."""
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if not scale > 0.0 or math.isinf(scale):
        raise ValueError(f"sm_scale={sm_scale}; allowed: a finite value > 0")
    return scale


def check_out_dtype(out_dtype, q_dtype) -> jnp.dtype:
    """None means q's dtype; otherwise a floating dtype (float32 for states that get merged)."""
    dtype = jnp.dtype(q_dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"out_dtype={out_dtype}; allowed: None or a floating dtype")
    return dtype


def check_attention_shapes(q, k, v, q_rank: int) -> tuple[int, int, int, int, int, int]:
    """Validate q/k/v and return (batch, tq, hq, tk, hkv, head_dim); tq is 1 for decode."""
    if q.ndim != q_rank:
        raise ValueError(f"q has shape {q.shape}; allowed: rank {q_rank}")
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"k has shape {k.shape} and v {v.shape}; allowed: equal shapes [B, Tk, Hkv, D]")
    if q_rank == 4:
        batch, tq, hq, d = q.shape
    else:
        batch, hq, d = q.shape
        tq = 1
    kb, tk, hkv, kd = k.shape
    if kb != batch or kd != d:
        raise ValueError(
            f"q has shape {q.shape} and k {k.shape}; allowed: same batch and head_dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}; allowed: Hq % Hkv == 0")
    if tk == 0:
        raise ValueError("k has 0 keys; allowed: Tk >= 1")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(
            f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; allowed: one dtype")
    return batch, tq, hq, tk, hkv, d


def _at_top_level() -> bool:
    """True when no jit/vmap/grad trace is active (jax only accepts compiler options there)."""
    try:
        from jax._src import core as jax_core
        return bool(jax_core.trace_state_clean())
    except (ImportError, AttributeError):  # private API moved: just use default options
        return False


def interpret_aware_jit(fn, static_argnames: tuple[str, ...]):
    """jax.jit that compiles top-level interpret-mode calls at XLA optimisation level 0, with XLA's fusion emitters.

    The interpreted kernel is a test vehicle on small shapes, where XLA's CPU backend spends
    ~3 s optimising nested loops that then run for milliseconds; level 0 compiles ~4x faster.
    The kernels' bit-level contracts (keys streamed in pieces give the bits of one call) hold in interpret mode
    only if a tile's products and sums come out the same whatever the surrounding shapes: so with XLA's fusion
    emitters (its default), also where XLA_FLAGS turns them off (the test suite does under jax 0.10, to compile
    faster); the older emitters give scores differing in the last bit between the two (jax 0.10.2).
    Compiled (Triton) calls and calls traced inside an outer jax.jit (where jax rejects
    per-call compiler options) keep the default options. `fn` must take a static `interpret`.
    """
    options = {"xla_backend_optimization_level": 0}
    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):  # an XLA that has the option
        options["xla_cpu_use_fusion_emitters"] = True
    fast = jax.jit(fn, static_argnames=static_argnames, compiler_options=options)
    normal = jax.jit(fn, static_argnames=static_argnames)

    def call(*args, interpret: bool, **kwargs):
        use_fast = interpret and _at_top_level()
        return (fast if use_fast else normal)(*args, interpret=interpret, **kwargs)

    call.jitted = (fast, normal)  # lets tests inspect the compilation caches
    return call


def load_rows(ref, rows, ok=None):
    """ref[rows, :] in one tile load; with `ok` (bool per row), rows where it is False read as 0."""
    if ok is None:
        return plgpu.load(ref.at[rows, :])
    return plgpu.load(ref.at[rows, :], mask=ok[:, None], other=0)


def empty_softmax_state(rows: int, head_dim: int):
    """(acc, m, l) of an online softmax that has seen no key yet."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def finish_online_softmax(acc, m_i, l_i):
    """-> (o float32, natural-log lse); a row that saw no key gets o = 0 and lse = -inf."""
    seen = l_i > 0.0
    l_safe = jnp.where(seen, l_i, 1.0)
    inv_l = jnp.where(seen, 1.0 / l_safe, 0.0)
    lse = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, NEG_INF)
    return acc * inv_l[:, None], lse


def load_kv_rows(ref, scale_ref, rows, ok, dtype):
    """Rows of a K or V tile in `dtype`: as stored, or (with `scale_ref`, one float32 scale per row) float8 or int8
    values times their scales, computed in float32 and rounded to `dtype` (exact for the power-of-two scales of an
    8-bit KV cache: the bits a dequantized bfloat16 cache holds). Rows where `ok` is False read as 0."""
    if scale_ref is None:
        return load_rows(ref, rows, ok)
    if ok is None:
        x = plgpu.load(ref.at[rows, :]).astype(jnp.float32) * plgpu.load(scale_ref.at[rows])[:, None]
        return x.astype(dtype)
    # Triton cannot cast a fill value to float8: masked rows are loaded as anything and zeroed after the scale.
    x = plgpu.load(ref.at[rows, :], mask=ok[:, None]).astype(jnp.float32)
    x = x * plgpu.load(scale_ref.at[rows], mask=ok)[:, None]
    return jnp.where(ok[:, None], x, 0.0).astype(dtype)


def decode_key_tile(carry, q, k_ref, v_ref, kslice, vslice, col_ok, *, scale_log2: float, precision,
                    k_scale_ref=None, v_scale_ref=None):
    """One key tile of a decode program (contiguous or paged): scores of the query group against the tile's keys,
    then `online_softmax_update`. `col_ok` None: every key of the tile is visible (the unmasked update); else
    keys where it is False are neither loaded nor counted. One function for both kernels, so that the offloaded
    decode and the paged decode run the same operations (and, on a GPU, get the same bits). With scale refs the
    tiles are dequantized in registers (`load_kv_rows`)."""
    masked = col_ok is not None
    k = load_kv_rows(k_ref, k_scale_ref, kslice, col_ok, q.dtype)
    # Raw scores; the scale is folded into the exponent (one FMA per element).
    s = plgpu.dot(q, k, trans_b=True, precision=precision)
    if masked:
        s = jnp.where(col_ok[None, :], s, NEG_INF)
    return online_softmax_update(carry, s, lambda: load_kv_rows(v_ref, v_scale_ref, vslice, col_ok, q.dtype),
                                 scale_log2=scale_log2, masked=masked, precision=precision)


def online_softmax_update(carry, s, load_v, *, scale_log2: float, masked: bool, precision):
    """One key tile of the online softmax shared by the prefill and decode kernels.

    carry = (acc, m, l) with m in scaled log2 units (m = max(s) * sm_scale * log2(e); the scale is > 0);
    `s` are raw scores with invisible keys already at -inf; `load_v()` loads the tile's values.
    """
    acc, m_i, l_i = carry
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * scale_log2)
    # A row with nothing visible yet keeps m = -inf; shift it by 0 to avoid inf - inf.
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m_i - m_use)
    # The scale is folded into the exponent (one FMA per element).
    p = jnp.exp2(s * scale_log2 - m_use[:, None])
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    v = load_v()
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l_i
