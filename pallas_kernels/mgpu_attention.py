"""Hopper flash-attention forward in Pallas's Mosaic GPU backend (TMA, wgmma, warp specialisation).

The contract of the Triton kernels of pallas_kernels/attention.py (`attention_with_lse`, `attention_state`),
for bfloat16/float16 inputs on an sm_90 GPU, less `q_positions`:
  q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]; query head h reads KV head h // (Hq // Hkv).
  Query i sits at key position q_offset + i (q_offset per batch row, default Tk - Tq); key j is visible to it
  iff kv_start[b, i] <= j < kv_len (kv_len per batch row, default Tk; kv_start per query row, default 0)
  and, when causal, j <= q_offset + i. kv_start packs several sequences into one batch row.
  `attention_with_lse_mgpu` returns o [B, Tq, Hq, D] in out_dtype (default float32, the unrounded
  accumulator) and lse [B, Hq, Tq] float32 in natural log, finished exactly as `finish_online_softmax`
  (pallas_kernels/_common.py) does; a row that sees no key gets o = 0 and lse = -inf.
  `attention_state_mgpu` returns the raw online-softmax state instead (`pallas_kernels.state.AttentionState`:
  acc [B, Tq, Hq, D], m and l [B, Hq, Tq], float32, base-2 units).
  Both continue an optional input state (the same type, over earlier keys) instead of the empty one.
  Any Tq and Tk: the wrapper pads q to a multiple of 2 * block_q rows and k/v to a multiple of block_kv
  keys (padded keys lie at or past kv_len, so they are always masked) and slices the padding off.

Streaming (what carrying a state is for). Keys cut into ascending blocks at multiples of block_kv, one call
per block with q_offset, kv_lengths and kv_start made relative to the block's first key, every call but the
last through `attention_state_mgpu` and the last through `attention_with_lse_mgpu(state=...)` (same config),
give the bits of one call over all the keys. Why:
  * Key tiles sit at the same absolute positions in every call (blocks start at multiples of block_kv; a
    call's partial last tile is padded with keys it masks) and a query row sits in the same Q tile, so each
    tile's scores come from the same wgmma on the same operands: the same bits, the same visibility.
  * A row's state goes through the same per-tile updates in the same (ascending) order; a state that
    crosses calls is stored and reloaded as exact float32.
  * A tile that only one side runs is invisible to the row (a CTA skips only tiles that none of its rows
    sees, and padding rows only add such tiles), and a fully masked tile leaves the state bit-identical:
    m stays, alpha = 2^(m - m) = 1, p = 0, so l and acc stay; a row that has seen nothing yet keeps
    m = -inf, l = 0, acc = 0 (m_use = 0: alpha = p = 0).
  * The masked and the unmasked update run the same operations on visible entries (the select passes s
    through, m_use = m_new once m_new is finite), so a tile that one call runs unmasked (the choice is per
    warpgroup and per call) and the other masked gives the same bits.
  * The finish is one formula applied once to the same final state.

Algorithm (FlashAttention-3 layout, one CTA = 3 warpgroups):
  * A CTA owns 2 * block_q query rows of one (batch, q head). Warpgroups 0 and 1 ("consumers") take
    block_q rows each; warpgroup 2 (the "producer") only issues TMA copies of K and V blocks into a ring
    of `max_concurrent_steps` shared-memory slots, waiting on per-slot "consumed" barriers before reuse.
  * Each consumer keeps its Q tile in shared memory, starts from the empty state or loads the input state
    of its rows from global memory straight into registers, and per KV block: S = Q K^T (wgmma, float32
    accumulator), online softmax in float32 registers, O += P V (wgmma, P rounded to the input dtype).
  * Softmax in base 2 with the scale folded into one constant c = sm_scale * log2(e) applied to the
    float32 scores: m = max_j(s_j) * c, p_j = 2^(s_j * c - m) (one FMA per element), l = sum_j p_j.
    Then sum_j e^(s_j * sm_scale) = 2^m * l, so the natural LSE is (m + log2(l)) * ln(2). q is never
    pre-scaled (no extra bf16 rounding), exactly as our Triton kernel.
  * The two consumers take turns on the tensor cores (FA3's ping-pong): while one runs its softmax the other's
    wgmmas run. The turns are handed over through the hardware's named barriers (`bar.sync` / `bar.arrive`, as FA3
    does), not shared-memory mbarriers, whose waits are polled: 3-5% faster on an H100, the same bits
    (`bench/results/runs/h100_mgpu_named_turns/`). On the GPU each step also overlaps inside a warpgroup (FA3's
    intra-warpgroup overlap): S_j = Q K_j^T and step j - 1's O += P V are issued together and step j's softmax
    runs while P V is still on the tensor cores; O is scaled by alpha_j after P V's wait, and P is rounded to the
    input dtype only then (a register an in-flight wgmma reads must not be redefined before its wait, or ptxas
    serializes every wgmma). The same operations on O in the same order as one step at a time, which is what
    Mosaic GPU's CPU interpreter runs (it has neither run_state nor register wgmma operands): the same bits.
  * Key blocks [first, num_steps) are the ones some row of the CTA may see: blocks past the CTA's last
    query (causal) or kv_len, and (kv_start) below the CTA's smallest start, are never loaded. Blocks
    visible to every row of a warpgroup run without any mask; only the others build the (iota) mask. Both
    consumers run the CTA's blocks (the same count keeps the barrier protocol in step, with no epilogue);
    the lower warpgroup's extra causal steps are fully masked and cost at most ceil(block_q / block_kv)
    blocks.
  * Block-sparse attention (pallas_kernels/mgpu_block_sparse.py) runs this kernel with a list of key blocks
    per CTA (`_attention_mgpu`'s block_lists): step j then loads and masks the list's j-th block instead of
    block j; the rest is the same.

Limits (`is_supported` says whether a call fits; the caller falls back to Triton otherwise): a Hopper
GPU (sm_90), bfloat16/float16 inputs, D in {64, 128}, block_q and block_kv multiples of 64, and tiles that
fit in shared memory. Written against jax 0.11.2's `jax.experimental.pallas.mosaic_gpu`; also lowers (and
runs in Mosaic GPU's CPU interpreter) under jax 0.10.

Why JAX's own `ops/gpu/attention_mgpu.py` cannot be used as is: its shared-memory scratch for Q/O, K and
V is hard-coded float16 (so bfloat16 inputs fail at the TMA copy or the wgmma), it applies no softmax
scale, returns a base-2 LSE, writes O in the input dtype and knows neither q_offset, kv_len, kv_start nor
an input state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (LN2, LOG2E, NEG_INF, check_sm_scale, mosaic_interpret_params, mosaic_load,
                                    on_hopper, per_batch, per_row)
from pallas_kernels.state import AttentionState, check_state

try:  # Importing runs no GPU code; a jax without Mosaic GPU only makes `is_supported` say False.
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
except ImportError:  # pragma: no cover
    plgpu = None

# Shared memory per block on sm_90 (H100/H200), opt-in maximum.
SMEM_LIMIT = 227 * 1024
_SMEM_ALIGN = 1024  # Mosaic GPU aligns every shared-memory buffer to 1 KiB.
_COMPUTE_WGS = 2
# Registers per thread: the consumers take what the producer gives back (FA3's split: 240 + 240 + 24 with 128
# threads per warpgroup stays within the 64K-register file). The overlapped causal steps spill 16 bytes at
# 232 + 232 + 40 and nothing at this split (H100, `bench/results/runs/h100_mgpu_schedule_tries/`).
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24

DEFAULT_CONFIG = dict(block_q=64, block_kv=128, max_concurrent_steps=2)
# The consumers' turns on the tensor cores use the hardware's named barriers 4 and 5 (0 is gpu.barrier's, 1-3 are
# Mosaic GPU's per-warpgroup barriers).
_TURN_BARRIER = 4


def _semantics(name: str):
    # jax 0.11 made Warpgroup the default lowering; 0.10 defaulted to Lane. Always pass one explicitly.
    return {"lane": plgpu.LoweringSemantics.Lane, "warpgroup": plgpu.LoweringSemantics.Warpgroup}[name]


def _align(n: int) -> int:
    return -(-n // _SMEM_ALIGN) * _SMEM_ALIGN


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def smem_bytes(block_q: int, block_kv: int, steps: int, head_dim: int, in_itemsize: int = 2,
               out_itemsize: int | None = 4, alias_out: bool = False, row_outs: int = 1) -> int:
    """Shared memory the kernel allocates, as Mosaic GPU counts it (buffers 1 KiB aligned) less the barriers
    (8 bytes each). out_itemsize None: O has the input dtype and goes out through Q's buffer. row_outs: float32
    per-row outputs staged for their copy out (1: lse; 2: the state's m and l)."""
    q = _align(_COMPUTE_WGS * block_q * head_dim * in_itemsize)
    kv = _align(steps * block_kv * head_dim * in_itemsize)
    rows = _align(row_outs * _COMPUTE_WGS * block_q * 4)
    o = 0 if out_itemsize is None else _align(_COMPUTE_WGS * block_q * head_dim * out_itemsize)
    if alias_out:  # O shares memory with Q and K, which are dead by the time O is written
        return max(q + kv, o) + kv + rows
    return q + 2 * kv + o + rows


def _check_blocks(d: int, block_q: int, block_kv: int, steps: int) -> str | None:
    if d not in (64, 128):
        return f"head_dim={d}; allowed: 64 or 128"
    if block_q % 64 or block_kv % 64 or block_q <= 0 or block_kv <= 0:
        return f"block_q={block_q}, block_kv={block_kv}; allowed: multiples of 64"
    if steps < 1:
        return f"max_concurrent_steps={steps}; allowed: >= 1"
    return None


def is_supported(q, k, v, *, block_q: int | None = None, block_kv: int | None = None,
                 max_concurrent_steps: int | None = None, out_dtype=jnp.float32, finish: bool = True) -> bool:
    """True when `attention_with_lse_mgpu` (finish) or `attention_state_mgpu` (not finish; its output is
    float32 whatever out_dtype says) can run this call here: a Hopper (sm_90) GPU is the default device,
    Mosaic GPU imports, bf16/f16 inputs of rank 4 with Hq % Hkv == 0, D in {64, 128}, block sizes multiples
    of 64 and tiles that fit in shared memory. Sequence lengths do not matter (the wrapper pads)."""
    if not on_hopper() or plgpu is None:
        return False
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.dtype != k.dtype or k.dtype != v.dtype:
        return False
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    b, tq, hq, d = q.shape
    kb, tk, hkv, kd = k.shape
    if kb != b or kd != d or hkv == 0 or hq % hkv or tk == 0:
        return False
    cfg = _resolve_config(tk, block_q, block_kv, max_concurrent_steps)
    if _check_blocks(d, cfg["block_q"], cfg["block_kv"], cfg["max_concurrent_steps"]):
        return False
    return _plan_smem(cfg, d, q.dtype, out_dtype if finish else jnp.float32, finish)[1] <= SMEM_LIMIT


def _resolve_config(tk, block_q, block_kv, steps) -> dict[str, int]:
    block_q = block_q or DEFAULT_CONFIG["block_q"]
    block_kv = block_kv or DEFAULT_CONFIG["block_kv"]
    steps = steps or DEFAULT_CONFIG["max_concurrent_steps"]
    # More slots than KV blocks would only hold copies nobody waits for.
    steps = max(1, min(steps, -(-tk // block_kv) if block_kv > 0 else 1))
    return dict(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps)


def _plan_smem(cfg, d, in_dtype, out_dtype, finish: bool) -> tuple[bool, int]:
    """(alias O with Q/K?, bytes): alias only when the plain layout does not fit."""
    separate_o = jnp.dtype(out_dtype) != jnp.dtype(in_dtype)
    args = (cfg["block_q"], cfg["block_kv"], cfg["max_concurrent_steps"], d, jnp.dtype(in_dtype).itemsize,
            jnp.dtype(out_dtype).itemsize if separate_o else None)
    row_outs = 1 if finish else 2
    plain = smem_bytes(*args, row_outs=row_outs)
    if plain <= SMEM_LIMIT or not separate_o:
        return False, plain
    return True, smem_bytes(*args, alias_out=True, row_outs=row_outs)


def _turn(instruction: str, own: bool) -> None:
    """FlashAttention-3's ping-pong on named barriers over both consumers' threads: consumer w waits for its turn at
    barrier _TURN_BARRIER + w (`bar.sync`, own=True) and hands the turn over by arriving at the other's (`bar.arrive`).
    A named barrier wakes its waiters in hardware, where an mbarrier's are polled through shared memory."""
    @plgpu.inline_mgpu()
    def emit(_):
        i32 = ir.IntegerType.get_signless(32)
        wg = mgpu_utils.warpgroup_idx(sync=True)
        if not own:
            wg = arith.xori(wg, mgpu_utils.c(1, i32))
        barrier = arith.addi(wg, mgpu_utils.c(_TURN_BARRIER, i32))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [barrier], f"{instruction} $0, {_COMPUTE_WGS * 128};", "r",
                        has_side_effects=True)

    emit()


def _attention_kernel(qoff_ref, kvlen_ref, q_ref, k_ref, v_ref, *refs, block_q, block_kv, steps, group, causal,
                      scale_log2, num_q_tiles, packed, resume, listed, finish, alias_out, separate_o, interpret):
    if packed:  # per-row starts [B, Tq]; per CTA (smallest start, largest of warpgroup 0, of warpgroup 1)
        start_ref, bounds_ref, *refs = refs
    if resume:
        acc0_ref, m0_ref, l0_ref, *refs = refs
    if listed:  # per CTA its key blocks [B, Hq, tiles, M], and counts [B, Hq, tiles, 3] (see _attention_mgpu)
        blocks_ref, counts_ref, *refs = refs
    num_outs = 2 if finish else 3  # (o, lse) or the state (acc, m, l)
    out_refs = refs[:num_outs]
    smem, k_ready, v_ready, q_ready, k_free, v_free, schedule = refs[num_outs:]

    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    if interpret:  # jax 0.10's CPU interpreter has neither layout_cast nor plgpu.load; layouts mean nothing there
        layout_cast = lambda x, layout: x  # noqa: E731
        load = lambda ref, layout: ref[...]  # noqa: E731
    else:
        layout_cast = plgpu.layout_cast

        def load(ref, layout):  # a global-memory tile straight into registers (only unoptimised loads exist)
            return mosaic_load(ref, layout=layout, optimized=False)

    def iota(dim):  # int32 [block_q, block_kv] index along `dim`, born in the layout of the scores
        return layout_cast(lax.broadcasted_iota(jnp.int32, (block_q, block_kv), dim), wgmma_layout)
    head_dim = q_ref.shape[-1]
    in_dtype = q_ref.dtype

    if alias_out:  # RefUnion((q, k), (o,)): O reuses the memory of Q and K
        ((q_smem, k_smem), (o_smem,)), v_smem, rows_smem = smem
    else:
        q_smem, k_smem, v_smem, o_smem, rows_smem = smem
    if not separate_o:
        o_smem = q_smem  # same dtype: each consumer writes O over its own (finished) Q tile

    batch = lax.axis_index("batch")
    q_head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile = lax.axis_index("q_seq")
    if causal:  # the last query tiles see the most keys: launch them first to shorten the tail
        tile = num_q_tiles - 1 - tile
    tile_rows = 2 * block_q
    q_offset = qoff_ref[batch]
    kv_len = kvlen_ref[batch]  # clamped to [0, Tk] by the wrapper

    # Steps [first, num_steps) are the KV blocks that may be visible to some row of this CTA; the producer loads
    # exactly these and both consumers step through all of them (the same count keeps the barrier phases in step).
    # Step j visits key block key_block(j): block j itself, or the j-th entry of the CTA's block list.
    if listed:
        def key_block(j):  # a scalar read from global memory; only entries below the count are ever read
            return blocks_ref[batch, q_head, tile, j]

        num_steps = counts_ref[batch, q_head, tile, 0]
    else:
        def key_block(j):
            return j

        if causal:
            hi = jnp.clip(q_offset + (tile + 1) * tile_rows, 0, kv_len)
        else:
            hi = kv_len
        num_steps = lax.div(hi + (block_kv - 1), jnp.int32(block_kv))
    if packed:  # no row of the CTA sees a key below its smallest start
        first = jnp.minimum(lax.div(jnp.clip(bounds_ref[batch, tile, 0], 0, hi), jnp.int32(block_kv)), num_steps)
    else:
        first = 0  # a Python int: a jnp constant closed over by run_state below fails to lower (warpgroup)

    def ring_slot(j):  # the ring slot of step j: blocks fill the slots in turn from `first` on
        return lax.rem(j - first, jnp.int32(steps))

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def issue_in_turn(issue):
        """The overlapped steps' ping-pong: wait for this consumer's turn, issue its wgmmas, hand the turn over."""
        _turn("bar.sync", own=True)
        issue()
        _turn("bar.arrive", own=False)

    # Warpgroup 1 starts one turn behind and warpgroup 0 takes that turn at the end, so that the two alternate on
    # the tensor cores: at the schedule barrier one step at a time (the CPU interpreter), through the named
    # barriers with overlapped steps (the GPU).
    if interpret:
        first_turn = last_turn = schedule_barrier
    else:
        first_turn = functools.partial(_turn, "bar.arrive", own=False)
        last_turn = functools.partial(_turn, "bar.sync", own=True)

    @pl.when(wg < _COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
        q_tile = q_smem.at[wg]
        q_base = tile * tile_rows + wg * block_q  # first query row of this warpgroup
        rows = pl.ds(q_base, block_q)
        first_pos = q_offset + q_base  # its key position
        # Steps [lo_full, hi_full) are visible to every row of this warpgroup: no mask at all.
        if listed:  # a prefix of the (ascending) list, counted by the caller
            lo_full, hi_full = first, counts_ref[batch, q_head, tile, 1 + wg]
        else:
            if causal:
                num_full = lax.div(jnp.clip(first_pos + 1, 0, kv_len), jnp.int32(block_kv))
            else:
                num_full = lax.div(kv_len, jnp.int32(block_kv))
            num_full = jnp.minimum(num_full, num_steps)
            if packed:  # blocks below the warpgroup's largest start are masked
                highest = jnp.clip(bounds_ref[batch, tile, 1 + wg], 0, hi)
                lo_full = jnp.clip(lax.div(highest + (block_kv - 1), jnp.int32(block_kv)), first, num_steps)
                hi_full = jnp.clip(num_full, lo_full, num_steps)
            else:
                lo_full, hi_full = first, num_full

        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], q_tile, q_ready.at[wg])
        # While Q is in flight: the starting state, and the rows' starts for the mask.
        if resume:  # continue an online softmax over earlier keys exactly where it stopped
            acc = load(acc0_ref.at[batch, rows, q_head], wgmma_layout)
            m_i = load(m0_ref.at[batch, q_head, rows], row_layout)
            l_i = load(l0_ref.at[batch, q_head, rows], row_layout)
        else:
            m_i = layout_cast(jnp.full((block_q,), NEG_INF, jnp.float32), row_layout)
            l_i = layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
            acc = layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), wgmma_layout)
        start_rows = load(start_ref.at[batch, rows], row_layout) if packed else None
        plgpu.barrier_wait(q_ready.at[wg])

        @pl.when(num_steps > first)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(first_turn)

        def softmax(s, j, m_i, l_i, masked: bool, cast: bool = True):
            """Step j's online-softmax update of a score tile s: (P in the input dtype, m, l, alpha)."""
            if masked:
                # Key col = k0 + c is visible to row r iff col < kv_len, (causal) col <= first_pos + r
                # and (packed) col >= start_r: c < kv_len - k0, c - r <= first_pos - k0, c >= start_r - k0.
                k0 = key_block(j) * block_kv
                cols = iota(1)
                vis = cols < kv_len - k0
                if causal:
                    vis = vis & (cols - iota(0) <= first_pos - k0)
                if packed:
                    vis = vis & (cols >= lax.broadcast_in_dim(start_rows - k0, s.shape, [0]))
                s = jnp.where(vis, s, NEG_INF)
            # Online softmax in base 2, scale folded into the exponent (m is in scaled log2 units).
            m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
            # A row with nothing visible yet keeps m = -inf; shift it by 0 to avoid inf - inf = NaN.
            m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l_i = l_i * alpha
            p_in = p.astype(in_dtype) if cast else p
            return p_in, m_new, l_i + p.sum(axis=1), alpha

        def scaled(acc, alpha):
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        def kv_step(j, carry, masked: bool):
            """One step at a time, the CPU interpreter's schedule (dots for the wgmmas: jax 0.10's interpreter
            can neither wgmma from a transposed ref nor take a register operand), with the GPU's barriers."""
            acc, m_i, l_i = carry
            slot = ring_slot(j)
            s = lax.dot_general(q_tile[...], k_smem.at[slot][...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
            schedule_barrier()
            plgpu.barrier_arrive(k_free.at[slot])
            p_in, m_new, l_i, alpha = softmax(s, j, m_i, l_i, masked)
            acc = scaled(acc, alpha)
            plgpu.barrier_arrive(schedule)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(schedule)  # the other warpgroup's wgmma has been issued
            acc = acc + lax.dot(p_in, v_smem.at[slot][...], preferred_element_type=jnp.float32)

            @pl.when(j + 1 < num_steps)
            def _():
                plgpu.barrier_wait(k_ready.at[ring_slot(j + 1)])

            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        def overlapped_steps(acc, m_i, l_i, lo_full, hi_full):
            """The GPU's schedule, FlashAttention-3's overlap inside a warpgroup: step j issues S_j = Q K_j^T and
            step j - 1's O += P V together, runs step j's softmax while P V is still on the tensor cores, and
            only then scales O by step j's alpha: the same operations on O in the same order as `kv_step` one
            step at a time (scale by alpha_j, add P_j V_j), so the same bits. The first step's S runs alone
            (masked: the same bits on visible keys), the last P V after the loop."""
            def first_step(j, carry):
                acc, m_i, l_i, _ = carry
                slot = ring_slot(j)

                def qk(s_ref):
                    issue_in_turn(lambda: plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0))))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                p_in, m_i, l_i, alpha = softmax(s, j, m_i, l_i, masked=True)
                return scaled(acc, alpha), m_i, l_i, p_in

            def step(j, carry, masked: bool):
                acc, m_i, l_i, p_prev = carry
                slot, prev = ring_slot(j), ring_slot(j - 1)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[prev])

                def gemms(refs):
                    o_ref, s_ref, m_ref, l_ref, alpha_ref = refs

                    def issue():
                        plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])

                    issue_in_turn(issue)
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_j only: P V runs on
                    plgpu.barrier_arrive(k_free.at[slot])
                    # P stays float32, in S's registers, while P V runs.
                    s_ref[...], m_ref[...], l_ref[...], alpha_ref[...] = softmax(
                        s, j, m_ref[...], l_ref[...], masked, cast=False)

                acc, p32, m_i, l_i, alpha = pl.run_state(gemms)(
                    (plgpu.ACC.init(acc),
                     plgpu.ACC.init(layout_cast(jnp.zeros((block_q, block_kv), jnp.float32), wgmma_layout)),
                     m_i, l_i, layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)))
                # The next P V's operand is rounded only now, with no wgmma in flight: a register that an
                # in-flight wgmma reads, defined before its wait, makes ptxas serialize every wgmma (C7513).
                p_in = p32.astype(in_dtype)
                plgpu.barrier_arrive(v_free.at[prev])
                return scaled(acc, alpha), m_i, l_i, p_in

            def last_pv(j, carry):
                acc, m_i, l_i, p_prev = carry
                slot = ring_slot(j)
                plgpu.barrier_wait(v_ready.at[slot])

                def pv(o_ref):
                    issue_in_turn(lambda: plgpu.wgmma(o_ref, p_prev, v_smem.at[slot]))

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_i, l_i, p_prev

            p0 = layout_cast(jnp.zeros((block_q, block_kv), in_dtype), wgmma_layout)
            carry = lax.fori_loop(first, jnp.minimum(first + 1, num_steps), first_step, (acc, m_i, l_i, p0))
            after = first + 1
            lo, hi = jnp.maximum(lo_full, after), jnp.maximum(hi_full, after)
            if packed:
                carry = lax.fori_loop(after, lo, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(hi, num_steps, functools.partial(step, masked=True), carry)
            acc, m_i, l_i, _ = lax.fori_loop(jnp.maximum(num_steps - 1, first), num_steps, last_pv, carry)
            return acc, m_i, l_i

        # [first, lo_full) masked (packed only), [lo_full, hi_full) unmasked, [hi_full, num_steps) masked:
        # num_steps - first steps for either warpgroup.
        if not interpret:
            acc, m_i, l_i = overlapped_steps(acc, m_i, l_i, lo_full, hi_full)
        else:
            carry = (acc, m_i, l_i)
            if packed:
                carry = lax.fori_loop(first, lo_full, functools.partial(kv_step, masked=True), carry)
            carry = lax.fori_loop(lo_full, hi_full, functools.partial(kv_step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(hi_full, num_steps, functools.partial(kv_step, masked=True), carry)
        # Warpgroup 0 takes the turn warpgroup 1 skipped; after it, warpgroup 1's last Q K^T is done,
        # so neither Q tile nor any K slot is read again (what makes aliasing O over them safe).
        pl.when(wg == 0)(last_turn)

        if finish:  # finish_online_softmax (pallas_kernels/_common.py), the same formula
            seen = l_i > 0.0
            l_safe = jnp.where(seen, l_i, 1.0)
            inv_l = jnp.where(seen, 1.0 / l_safe, 0.0)
            lse = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, NEG_INF)
            tile_out, row_outs = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0]), (lse,)
        else:
            tile_out, row_outs = acc, (m_i, l_i)
        o_tile = o_smem.at[wg]
        o_tile[...] = tile_out.astype(o_smem.dtype)
        for n, x in enumerate(row_outs):
            row_tile = rows_smem.at[n, wg]
            row_tile[...] = x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_tile, out_refs[0].at[batch, rows, q_head])
        for n, ref in enumerate(out_refs[1:]):
            plgpu.copy_smem_to_gmem(rows_smem.at[n, wg], ref.at[batch, q_head, rows])
        # Only until the copies have read shared memory: their writes land before the kernel ends, and the SM
        # takes the next CTA sooner (`bench/results/runs/h100_store_wait/`).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == _COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
        kv_head = lax.div(q_head, jnp.int32(group))
        num_blocks = num_steps - first

        def copy(ref, smem_ref, ready, block, slot):
            plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(block * block_kv, block_kv), kv_head],
                                    smem_ref.at[slot], ready.at[slot])

        def issue(i):  # the i-th step of this CTA into slot i
            block = key_block(first + i)
            copy(k_ref, k_smem, k_ready, block, i)
            copy(v_ref, v_smem, v_ready, block, i)

        for i in range(steps):  # fill the ring; never copy a block nobody will wait for
            pl.when(i < num_blocks)(functools.partial(issue, i))

        def refill(i, _):
            slot = lax.rem(i, jnp.int32(steps))
            block = key_block(first + i)  # before the wait: a list entry's read overlaps it
            # K and V slots are released separately (K right after S = Q K^T), so K can be refilled early.
            plgpu.barrier_wait(k_free.at[slot])
            copy(k_ref, k_smem, k_ready, block, slot)
            plgpu.barrier_wait(v_free.at[slot])
            copy(v_ref, v_smem, v_ready, block, slot)
            return None

        refilled = jnp.maximum(num_blocks, steps)
        lax.fori_loop(jnp.int32(steps), refilled, refill, None)

        def drain(i, _):
            # Observe the releases of the last blocks too. Not needed on the GPU (nothing waits on those
            # phases), but it keeps every barrier phase observed, which Mosaic GPU's CPU interpreter checks.
            slot = lax.rem(i, jnp.int32(steps))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            return None

        lax.fori_loop(refilled, num_blocks + steps, drain, None)


def _pad_axis(x, axis: int, size: int, value=0):
    """x padded with `value` along `axis` up to `size` (x itself when it is that long)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


@functools.partial(jax.jit, static_argnames=("finish", "causal", "sm_scale", "out_dtype", "block_q", "block_kv",
                                             "max_concurrent_steps", "semantics", "interpret"))
def _attention_mgpu(q, k, v, q_offset, kv_len, kv_start, state, block_lists=None, *, finish, causal, sm_scale,
                    out_dtype, block_q, block_kv, max_concurrent_steps, semantics, interpret):
    """The kernel's launch. block_lists (block-sparse attention, `mgpu_block_sparse`): None, or (blocks int32
    [B, Hq, num_q_tiles, M], counts int32 [B, Hq, num_q_tiles, 3]). CTA (b, h, tile) then visits the key blocks
    blocks[b, h, tile, :counts[..., 0]] (ascending, each a block some row of the CTA may see) instead of every
    block some row may see, and runs the first counts[..., 1 + w] of them without a mask in warpgroup w (each
    visible to every row of it)."""
    batch, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    tile_rows = 2 * block_q
    # Padding: query rows up to whole CTAs (their results are sliced off; they only add key blocks that are
    # fully masked for the real rows), keys up to whole blocks (past kv_len <= Tk, so always masked).
    tq_pad, tk_pad = _round_up(tq, tile_rows), _round_up(tk, block_kv)
    num_q_tiles = tq_pad // tile_rows
    q = _pad_axis(q, 1, tq_pad)
    k, v = _pad_axis(k, 1, tk_pad), _pad_axis(v, 1, tk_pad)
    extra = []
    if kv_start is not None:
        # Padding rows repeat the last real start, so they widen no CTA's range of blocks.
        starts = jnp.pad(kv_start, ((0, 0), (0, tq_pad - tq)), mode="edge")
        per_wg = starts.reshape(batch, num_q_tiles, _COMPUTE_WGS, block_q)
        bounds = jnp.concatenate([per_wg.min(axis=(2, 3))[..., None], per_wg.max(axis=3)], axis=-1)
        extra += [starts, bounds]
    if state is not None:
        extra += [_pad_axis(state.acc, 1, tq_pad), _pad_axis(state.m, 2, tq_pad, NEG_INF),
                  _pad_axis(state.l, 2, tq_pad)]
    if block_lists is not None:
        assert kv_start is None and block_lists[1].shape == (batch, hq, num_q_tiles, 3)
        assert block_lists[0].shape[:3] == (batch, hq, num_q_tiles)
        extra += list(block_lists)

    cfg = dict(block_q=block_q, block_kv=block_kv, max_concurrent_steps=max_concurrent_steps)
    tile_dtype = out_dtype if finish else jnp.dtype(jnp.float32)
    alias_out, _ = _plan_smem(cfg, d, q.dtype, tile_dtype, finish)
    alias_out = alias_out and not interpret  # the CPU interpreter has no RefUnion (and no memory limit)
    separate_o = tile_dtype != jnp.dtype(q.dtype)

    def tiled(shape, dtype):
        # 128-byte swizzle with (8, 128 B) tiles: the layout wgmma reads and TMA writes without bank conflicts.
        swizzle_elems = 128 // jnp.dtype(dtype).itemsize
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle_elems)),
                                                    plgpu.SwizzleTransform(128)))

    q_s = tiled((_COMPUTE_WGS, block_q, d), q.dtype)
    k_s = tiled((max_concurrent_steps, block_kv, d), k.dtype)
    v_s = tiled((max_concurrent_steps, block_kv, d), v.dtype)
    o_s = tiled((_COMPUTE_WGS, block_q, d), tile_dtype) if separate_o else None
    rows_s = plgpu.SMEM((1 if finish else 2, _COMPUTE_WGS, block_q), jnp.float32)  # lse, or m and l
    if alias_out:
        smem = (plgpu.RefUnion((q_s, k_s), (o_s,)), v_s, rows_s)
    else:
        smem = (q_s, k_s, v_s, o_s, rows_s)

    kernel = functools.partial(
        _attention_kernel, block_q=block_q, block_kv=block_kv, steps=max_concurrent_steps, group=hq // hkv,
        causal=causal, scale_log2=sm_scale * LOG2E, num_q_tiles=num_q_tiles, packed=kv_start is not None,
        resume=state is not None, listed=block_lists is not None, finish=finish, alias_out=alias_out,
        separate_o=separate_o, interpret=interpret)
    rows_f32 = jax.ShapeDtypeStruct((batch, hq, tq_pad), jnp.float32)
    out_type = (jax.ShapeDtypeStruct((batch, tq_pad, hq, d), tile_dtype),) + (rows_f32,) * (1 if finish else 2)
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            smem,
            plgpu.Barrier(num_barriers=max_concurrent_steps),  # k_ready (TMA completes it)
            plgpu.Barrier(num_barriers=max_concurrent_steps),  # v_ready
            plgpu.Barrier(num_barriers=_COMPUTE_WGS),  # q_ready
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=max_concurrent_steps),  # k_free
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=max_concurrent_steps),  # v_free
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS),  # schedule: the consumers' ping-pong, one step at a time
        ),
        grid=(hq, num_q_tiles, batch),  # heads fastest: the G heads of one KV head share it in L2
        grid_names=("heads", "q_seq", "batch"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        interpret=mosaic_interpret_params() if interpret else None,
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            # Row reductions of the wgmma layout stay inside a warp: no cross-warp scratch needed, and
            # the 2 KiB it would take is what lets block_kv=128 with a float32 O fit in 227 KiB.
            reduction_scratch_bytes=0,
            lowering_semantics=_semantics(semantics)),
    )(q_offset, kv_len, q, k, v, *extra)
    tile_out, *row_outs = out
    out = (tile_out[:, :tq], *(x[..., :tq] for x in row_outs))
    return out if finish else AttentionState(*out)


def _launch(q, k, v, state, *, finish, causal, q_offset, kv_lengths, kv_start, sm_scale, out_dtype, block_q,
            block_kv, max_concurrent_steps, semantics, interpret, block_lists=None):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}; allowed: [B, Tq, Hq, D] and equal [B, Tk, Hkv, D]")
    batch, tq, hq, d = q.shape
    kb, tk, hkv, kd = k.shape
    if kb != batch or kd != d or hkv == 0 or hq % hkv:
        raise ValueError(f"q {q.shape} and k {k.shape}: need the same B and D and Hq % Hkv == 0")
    if tk == 0:
        raise ValueError("k has 0 keys; allowed: Tk >= 1")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}; allowed: one dtype")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype {q.dtype}; allowed: bfloat16 or float16 (wgmma operands)")
    cfg = _resolve_config(tk, block_q, block_kv, max_concurrent_steps)
    if (err := _check_blocks(d, cfg["block_q"], cfg["block_kv"], cfg["max_concurrent_steps"])) is not None:
        raise ValueError(err)
    out_dtype = jnp.dtype(out_dtype)
    if (need := _plan_smem(cfg, d, q.dtype, out_dtype, finish)[1]) > SMEM_LIMIT:
        raise ValueError(f"config {cfg} needs {need} B of shared memory; limit {SMEM_LIMIT}")
    if state is not None:
        check_state(state, batch, tq, hq, d)
    q_offset = per_batch(tk - tq if q_offset is None else q_offset, batch, "q_offset")
    kv_len = jnp.clip(per_batch(tk if kv_lengths is None else kv_lengths, batch, "kv_lengths"), 0, tk)
    return _attention_mgpu(q, k, v, q_offset, kv_len, per_row(kv_start, batch, tq), state, block_lists,
                           finish=finish, causal=bool(causal), sm_scale=check_sm_scale(sm_scale, d),
                           out_dtype=out_dtype, semantics=semantics, interpret=bool(interpret), **cfg)


def attention_with_lse_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, q_offset=None,
                            kv_lengths=None, kv_start: jax.Array | None = None, state: AttentionState | None = None,
                            sm_scale: float | None = None, out_dtype=jnp.float32, block_q: int | None = None,
                            block_kv: int | None = None, max_concurrent_steps: int | None = None,
                            semantics: str = "warpgroup", interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Flash attention forward (Mosaic GPU, Hopper) with GQA, causal offset, per-batch key length, packed
    sequences, an optional input state, and LSE.

    Args:
      q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; bfloat16 (or float16), Hq % Hkv == 0, D in {64, 128}; any
        Tq and Tk >= 1.
      causal: query i sees key j only if j <= q_offset + i.
      q_offset: position of query 0 in the keys; int or int32 array (scalar or [B]), may be traced;
        None means Tk - Tq (queries are the last Tq of the keys).
      kv_lengths: keys j >= kv_lengths[b] are invisible; int or int32 (scalar or [B]), may be traced;
        None means Tk. Clamped to [0, Tk].
      kv_start: int32 [B, Tq] or None; query i sees no key j < kv_start[b, i] (sequences packed into one
        batch row). Key blocks below a CTA's smallest start are never loaded.
      state: an `AttentionState` over earlier keys (from `attention_state_mgpu`, or any kernel's state) to
        continue instead of the empty one; see the module docstring for the bitwise streaming contract.
      sm_scale: score scale, default 1/sqrt(D); applied in float32 inside the exponent. Static.
      out_dtype: dtype of o (float32 default: the unrounded accumulator; bfloat16 possible). Static.
      block_q: query rows per consumer warpgroup (a CTA takes 2 * block_q); block_kv: keys per step;
        max_concurrent_steps: K/V ring slots. None takes DEFAULT_CONFIG.
      semantics: Mosaic GPU lowering, "warpgroup" (jax 0.11's default) or "lane".
      interpret: run Mosaic GPU's CPU interpreter instead (tests only; slow, small shapes).

    Returns:
      o [B, Tq, Hq, D] in out_dtype and lse [B, Hq, Tq] float32 (natural log), `finish_online_softmax` of
      the final state; rows that see no key (here or in `state`) get o = 0 and lse = -inf.
    """
    return _launch(q, k, v, state, finish=True, causal=causal, q_offset=q_offset, kv_lengths=kv_lengths,
                   kv_start=kv_start, sm_scale=sm_scale, out_dtype=out_dtype, block_q=block_q, block_kv=block_kv,
                   max_concurrent_steps=max_concurrent_steps, semantics=semantics, interpret=interpret)


def attention_state_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, state: AttentionState | None = None, *,
                         causal: bool = True, q_offset=None, kv_lengths=None, kv_start: jax.Array | None = None,
                         sm_scale: float | None = None, block_q: int | None = None, block_kv: int | None = None,
                         max_concurrent_steps: int | None = None, semantics: str = "warpgroup",
                         interpret: bool = False) -> AttentionState:
    """The kernel of `attention_with_lse_mgpu` stopped before its finish: continues `state` (None: no key seen
    yet) over k, v and returns the raw float32 online-softmax state (acc [B, Tq, Hq, D], m and l [B, Hq, Tq]).
    Same arguments as `attention_with_lse_mgpu`. Keys streamed in blocks whose sizes are multiples of block_kv,
    in ascending order (q_offset, kv_lengths and kv_start relative to each block's first key), with the last
    call made through `attention_with_lse_mgpu(state=...)`, give the bits of one call over all the keys."""
    return _launch(q, k, v, state, finish=False, causal=causal, q_offset=q_offset, kv_lengths=kv_lengths,
                   kv_start=kv_start, sm_scale=sm_scale, out_dtype=jnp.float32, block_q=block_q,
                   block_kv=block_kv, max_concurrent_steps=max_concurrent_steps, semantics=semantics,
                   interpret=interpret)
