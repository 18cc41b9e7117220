"""Hopper block-sparse prefill attention (XAttention's) in Pallas's Mosaic GPU backend: the flash-attention
kernel of mgpu_attention.py walking a list of key blocks per query block.

The contract of `block_sparse.block_sparse_attention_with_lse` (its Triton kernel), for bfloat16/float16
inputs, D in {64, 128} and block_size 128 on an sm_90 GPU:
  q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]; query head h reads KV head h // (Hq // Hkv).
  Query block i (rows [128 i, 128 (i + 1))) of head h visits the key blocks
  kv_blocks[b, h, i, :kv_block_counts[b, h, i]] (ascending, distinct, in [0, ceil(Tk / 128)); block j is keys
  [128 j, 128 (j + 1))); the entries past the count are padding and never read. Inside a visited block, key j
  is visible to query row r iff j < kv_len and (not causal or j <= q_offset + r).
  o [B, Tq, Hq, D] in out_dtype (default q.dtype); lse [B, Hq, Tq] float32, natural log, finished exactly as
  `finish_online_softmax` does; a row that sees no key gets o = 0 and lse = -inf.

How: one CTA of the dense kernel is 2 * 64 query rows (two consumer warpgroups), i.e. exactly one query block,
and its key step is 128 keys, one key block. Instead of every block some row of the CTA may see, its producer
TMA-loads only the listed ones (each list entry read from global memory as it goes; an empty list loads
nothing) and its consumers step through the same list. A listed block is visited only if some row of the CTA
may see it (causal: below the CTA's last position; below kv_len), and runs without a mask in a warpgroup iff
every row of that warpgroup sees all of it; only blocks that straddle the diagonal or kv_len build a mask.
Because the lists are ascending, both sets are prefixes of a list: the wrapper counts them per CTA (one jnp
pass over the lists) and the kernel reads three numbers.

With every block listed that the dense kernel visits (e.g. all key blocks), the steps are the dense kernel's
steps, in the same order, masked the same way, with the same arithmetic: the result has exactly the bits of
`mgpu_attention.attention_with_lse_mgpu` (its default tiles; causal, q_offset, kv_lengths=kv_len and out_dtype
the same). Against the Triton kernel it agrees to bf16 rounding only (other tiles, another order of sums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import mgpu_attention as mga
from pallas_kernels._common import check_attention_shapes, check_block_lists, check_out_dtype, per_batch

# The only block size: a query block is one CTA (two consumer warpgroups of BLOCK_SIZE // 2 rows), a key block
# one KV step.
BLOCK_SIZE = 128
_BLOCK_Q = BLOCK_SIZE // 2


def is_supported(q, k, v, *, block_size: int = BLOCK_SIZE, out_dtype=None,
                 max_concurrent_steps: int | None = None) -> bool:
    """True when `block_sparse_attention_with_lse_mgpu` can run this call here: block_size 128 and whatever
    `mgpu_attention.is_supported` asks (an sm_90 GPU, bf16/f16 inputs, D 64 or 128, tiles that fit in shared
    memory). The block lists do not matter."""
    return block_size == BLOCK_SIZE and mga.is_supported(
        q, k, v, block_q=_BLOCK_Q, block_kv=BLOCK_SIZE, max_concurrent_steps=max_concurrent_steps,
        out_dtype=check_out_dtype(out_dtype, q.dtype))


@functools.partial(jax.jit, static_argnames=("causal",))
def _step_counts(kv_blocks, counts, q_offset, kv_len, *, causal: bool) -> jax.Array:
    """int32 [B, Hq, nqb, 3]: per CTA (query block), how many entries of its list it visits and how many of
    those warpgroup 0 and warpgroup 1 run unmasked: the listed blocks below the dense kernel's bounds
    (mgpu_attention._attention_kernel: num_steps for the CTA, num_full per warpgroup), which with ascending
    lists are prefixes of the list."""
    nqb = kv_blocks.shape[2]
    tile_row0 = jnp.arange(nqb, dtype=jnp.int32) * BLOCK_SIZE  # [nqb]
    qo, kv = q_offset[:, None], kv_len[:, None]  # [B, 1]
    if causal:  # keys some row of the CTA may see (its padding rows included, as the dense kernel counts them)
        hi = jnp.clip(qo + tile_row0 + BLOCK_SIZE, 0, kv)
        # keys every row of warpgroup w sees: up to its first row's position, below kv_len
        full = [jnp.clip(qo + tile_row0 + w * _BLOCK_Q + 1, 0, kv) for w in (0, 1)]
    else:
        hi = jnp.broadcast_to(kv, (kv.shape[0], nqb))
        full = [hi, hi]
    num_steps = -(-hi // BLOCK_SIZE)  # [B, nqb], in blocks
    bounds = [num_steps] + [jnp.minimum(f // BLOCK_SIZE, num_steps) for f in full]
    live = jnp.arange(kv_blocks.shape[3], dtype=jnp.int32) < counts[..., None]  # padding entries are never read

    def listed_below(n):  # [B, nqb] -> [B, Hq, nqb]: live entries naming a block < n
        return jnp.sum(live & (kv_blocks < n[:, None, :, None]), axis=-1, dtype=jnp.int32)

    return jnp.stack([listed_below(n) for n in bounds], axis=-1)


def block_sparse_attention_with_lse_mgpu(
        q: jax.Array, k: jax.Array, v: jax.Array, kv_blocks: jax.Array, kv_block_counts: jax.Array, *,
        block_size: int = BLOCK_SIZE, causal: bool = False, q_offset=0, kv_len=None, sm_scale: float | None = None,
        out_dtype=None, max_concurrent_steps: int | None = None, semantics: str = "warpgroup",
        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Flash attention over the listed key blocks of every query block (Mosaic GPU, Hopper), with GQA and LSE.

    Args:
      q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; bfloat16 (or float16), Hq % Hkv == 0, D in {64, 128}; any Tq
        and Tk >= 1 (padded inside).
      kv_blocks: int [B, Hq, ceil(Tq / 128), max_blocks]; row (b, h, i) lists the key blocks query block i of
        head h attends, ascending and distinct, in [0, ceil(Tk / 128)). May be traced.
      kv_block_counts: int [B, Hq, ceil(Tq / 128)]; only the first counts[b, h, i] entries of a row are read
        (clamped to [0, max_blocks]). May be traced.
      block_size: must be 128 (`is_supported`).
      causal, q_offset, kv_len, sm_scale, out_dtype: as in `block_sparse_attention_with_lse` (q_offset and
        kv_len int or int32, scalar or [B], may be traced; q_offset default 0; kv_len clamped to [0, Tk]).
      max_concurrent_steps: K/V ring slots, default mgpu_attention.DEFAULT_CONFIG's.
      semantics: Mosaic GPU lowering, "warpgroup" (jax 0.11's default) or "lane".
      interpret: run Mosaic GPU's CPU interpreter instead (tests only; slow, small shapes).

    Returns:
      o [B, Tq, Hq, D] in out_dtype (default q.dtype) and lse [B, Hq, Tq] float32 (natural log). Rows with no
      visible key give o = 0 and lse = -inf. Unlisted key blocks, and listed ones no row of the query block can
      see, are never loaded.
    """
    if block_size != BLOCK_SIZE:
        raise ValueError(f"block_size={block_size}; allowed: {BLOCK_SIZE} (one CTA per query block)")
    batch, tq, hq, tk, _, _ = check_attention_shapes(q, k, v, 4)
    kv_blocks, counts = check_block_lists(kv_blocks, kv_block_counts, batch, hq, -(-tq // BLOCK_SIZE))
    q_offset = per_batch(q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_len is None else kv_len, batch, "kv_len"), 0, tk)
    steps = _step_counts(kv_blocks, counts, q_offset, kv_len, causal=bool(causal))
    return mga._launch(q, k, v, None, finish=True, causal=causal, q_offset=q_offset, kv_lengths=kv_len,
                       kv_start=None, sm_scale=sm_scale, out_dtype=check_out_dtype(out_dtype, q.dtype),
                       block_q=_BLOCK_Q, block_kv=BLOCK_SIZE, max_concurrent_steps=max_concurrent_steps,
                       semantics=semantics, interpret=interpret, block_lists=(kv_blocks, steps))
