"""A request's bfloat16 tokens do not depend on how it was run: alone, batched with others, or offloaded.

Kernels (Pallas interpret mode): the batch-invariant matmul gives each row the same bits for every row count and
launch config, in either order (prompt tokens sum K in one pass, generated tokens in 1,024-key chunks; which order
each path's matmuls take is recorded as they are traced); decode attention over a paged pool, folded in fixed splits,
gives each sequence the bits it gets alone and the bits of the offloaded decode's contiguous pieces. Engine (CPU,
XLA's kernels, tiny Llama, Qwen2 and Qwen3 in bfloat16): prompts of 5..700 tokens alone, together, offloaded (alone
and together) and after their first halves were cached give the same greedy tokens, and six Qwen3 prompts the same
seeded tokens alone and together (chunked offloaded prefill equals in-GPU in tests/test_offload_bf16.py; every
max_num_seqs 1..10, 60 tokens, block 256 and 512: bench/probes/probe_cpu_bf16_identity.py). On the CPU one prompt runs
the one-request path and several the batch engine; their decode attention agrees because the paged twin attends one
sequence at a time with the contiguous twin's arithmetic (batched, a sequence's bits changed with the batch size: a
700-token prompt's at its 21st token).
The engine tests run the default config, batch-invariant, which changes nothing on the CPU and is what makes it hold
on a GPU (with `batch_invariant=False`, on an H100, the first prompt's greedy tokens alone and together part at the
11th token: bench/results/runs/h100_gpu_tests/README.md; the Llama-3.1-8B shape:
bench/results/runs/h200_batch_invariance/).
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import tiny_models
from jax_offload import LLM, SamplingParams
from jax_offload.config import ModelConfig, RopeConfig
from jax_offload.models import decoder
from jax_offload.precision import sum_last_axis
from jax_offload.models.params import LayerParams, ModelParams
from jax_offload.precision import step_jit


def _bits(x) -> np.ndarray:
    return np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("rows,width", [(3, 100), (1024, 4096)])
def test_rms_norm_row_sum_is_one_fixed_tree(rows, width):
    """RMSNorm's row sum adds element i to i + half, level by level (split in two fusions from 1024 rows on): bit for
    bit the same tree run in float32 NumPy, and a row summed alone gives its bits in the block."""
    seed = 4300 + rows
    x = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    ref = np.pad(x, [(0, 0), (0, (1 << (width - 1).bit_length()) - width)])
    while ref.shape[-1] > 1:
        half = ref.shape[-1] // 2
        ref = ref[:, :half] + ref[:, half:]
    got = np.asarray(sum_last_axis(jnp.asarray(x)))
    np.testing.assert_array_equal(got, ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(sum_last_axis(jnp.asarray(x[-1:]))), got[-1:], err_msg=f"seed {seed}")


@pytest.mark.parametrize("k,n,transpose_w", [(192, 96, False), (320, 64, True)])
def test_matmul_rows_are_batch_invariant(k, n, transpose_w):
    seed = 4000 + k
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((70, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)) / np.sqrt(k), jnp.bfloat16)
    w64 = np.asarray(w, np.float64)
    ref = np.asarray(x, np.float64) @ (w64.T if transpose_w else w64)
    full = _bits(pk.matmul(x, w, transpose_w=transpose_w))
    assert np.abs(full - ref).max() <= 2 ** -7 * np.abs(ref).max(), f"seed {seed}"
    tiles = k // 64
    for m, block_m, block_n, k_unroll in [(1, 16, 32, 1), (3, 64, 16, tiles), (17, 16, None, 1), (70, 128, 32, tiles)]:
        got = _bits(pk.matmul(x[:m], w, transpose_w=transpose_w, block_m=block_m, block_n=block_n, k_unroll=k_unroll))
        assert np.array_equal(got, full[:m]), \
            f"seed {seed}: rows of M={m} (tiles {block_m}x{block_n}, {k_unroll} K tiles a step) differ"


@pytest.mark.parametrize("transpose_w,one_pass", [(True, False), (False, True)])
def test_matmul_chunks_of_k_give_the_same_bits_in_either_form(transpose_w, one_pass):
    """K of two chunks (`K_CHUNK` keys each, their sums added in order; a tied LM head's transposed table), or in one
    pass (`one_pass`, a prompt's order): a program per chunk (`split_k`, the decode form) and one program over both
    give the same bits at every row count, each row its bits in the full batch, close to float64; the two orders'
    float32 sums differ. (Untransposed chunks: test_deep_k_adds_its_chunks_in_two_groups.)"""
    from pallas_kernels.matmul import K_CHUNK

    seed = 4017 + transpose_w + 2 * one_pass
    rng = np.random.default_rng(seed)
    k, n = 2 * K_CHUNK, 64
    x = jnp.asarray(rng.standard_normal((40, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)) / np.sqrt(k), jnp.bfloat16)
    w64 = np.asarray(w, np.float64)
    ref = np.asarray(x, np.float64) @ (w64.T if transpose_w else w64)
    full = _bits(pk.matmul(x, w, transpose_w=transpose_w, one_pass=one_pass, split_k=False))
    assert np.abs(full - ref).max() <= 2 ** -7 * np.abs(ref).max(), f"seed {seed}"
    for m, split_k, block_n, k_unroll in [(1, True, 32, 1), (1, False, 16, 4), (5, True, 64, 16), (40, True, 32, 2)]:
        got = _bits(pk.matmul(x[:m], w, transpose_w=transpose_w, one_pass=one_pass, split_k=split_k, block_n=block_n,
                              k_unroll=k_unroll))
        assert np.array_equal(got, full[:m]), \
            f"seed {seed}: rows of M={m} (split_k {split_k}, block_n {block_n}, {k_unroll} K tiles a step) differ"
    if one_pass:  # another order: in float32 most sums of 2,048 products differ in their last bits
        sums = [np.asarray(pk.matmul(x, w, one_pass=p, out_dtype=jnp.float32)) for p in (True, False)]
        np.testing.assert_allclose(sums[0], ref, rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}")
        assert (sums[0] != sums[1]).mean() > 0.5, f"seed {seed}: one pass gave the chunks' float32 sums"


def test_deep_k_adds_its_chunks_in_two_groups():
    """K of GROUPED_CHUNKS chunks (the 8B's w_down has 14) adds each half's chunk sums in order, then the two halves'
    sums: float32 NumPy adding the kernel's one-pass chunk sums so gives the output's bits, in every form (a program
    per chunk at one and five rows, one program over all of K), and not a single run over the chunks."""
    from pallas_kernels.matmul import GROUPED_CHUNKS, K_CHUNK

    seed = 4023
    rng = np.random.default_rng(seed)
    k, n = GROUPED_CHUNKS * K_CHUNK, 32
    x = jnp.asarray(rng.standard_normal((5, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    chunk_sums = [np.asarray(pk.matmul(x[:, c * K_CHUNK:(c + 1) * K_CHUNK], w[c * K_CHUNK:(c + 1) * K_CHUNK],
                                       one_pass=True, out_dtype=jnp.float32)) for c in range(GROUPED_CHUNKS)]
    half = GROUPED_CHUNKS // 2
    groups = [functools.reduce(operator.add, chunk_sums[g * half:(g + 1) * half]) for g in range(2)]
    ref = groups[0] + groups[1]
    for m, split_k in [(5, False), (5, True), (1, True)]:
        got = np.asarray(pk.matmul(x[:m], w, out_dtype=jnp.float32, split_k=split_k, block_n=n))
        np.testing.assert_array_equal(got, ref[:m], err_msg=f"seed {seed}: M={m}, split_k {split_k}")
    assert (ref != functools.reduce(operator.add, chunk_sums)).mean() > 0.05, \
        f"seed {seed}: the two groups' order gave a single run's sums"


def test_wide_weights_sum_k_in_one_pass_for_every_token():
    """A weight of ONE_PASS_N columns (w_gate_up, LM heads: a program per column block reads all of K even at one row)
    sums K in one pass for generated tokens too: the bits of `one_pass=True`, not the chunks' order (each K_CHUNK's
    sum from zero, then added)."""
    from pallas_kernels.matmul import K_CHUNK, ONE_PASS_N

    seed = 4021
    rng = np.random.default_rng(seed)
    k, n = 2 * K_CHUNK, ONE_PASS_N
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    sums = lambda x, **kw: np.asarray(pk.matmul(x, w, out_dtype=jnp.float32, block_n=n, **kw))  # noqa: E731
    generated = sums(x)
    np.testing.assert_array_equal(generated, sums(x, one_pass=True), err_msg=f"seed {seed}")
    halves = [np.asarray(pk.matmul(x[:, c * K_CHUNK:(c + 1) * K_CHUNK], w[c * K_CHUNK:(c + 1) * K_CHUNK],
                                   one_pass=True, out_dtype=jnp.float32, block_n=n)) for c in range(2)]
    assert (generated != halves[0] + halves[1]).mean() > 0.5, f"seed {seed}: a wide weight summed K in chunks"


def test_matmul_lowers_for_cuda():
    """The Triton matmul lowers for the GPU in each form the 8B shape takes (its values are the interpret mode's,
    checked above): a decode row with a program per chunk of K (`w_down`), three rows masked in a 16-row tile over a
    tied LM head, rows looping over K's chunks in one program, and over w_down's two groups of chunks."""
    for m, k, n, transpose_w in ((1, 14336, 4096, False), (3, 4096, 8192, True), (128, 4096, 4096, False),
                                 (256, 14336, 4096, False)):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((n, k) if transpose_w else (k, n), jnp.bfloat16)
        jax.jit(lambda x, w, t=transpose_w: pk.matmul(x, w, transpose_w=t, interpret=False)).trace(x, w).lower(
            lowering_platforms=("cuda",))


def _assert_fold_is_the_float64_merge(state, o, lse, live, seed: int) -> None:
    got, _ = pk.finish_state(state)
    for row in range(len(live)):
        w = np.exp(lse[:live[row], row].astype(np.float64))  # [S, Hkv, G]
        want = np.einsum("shg,shgd->hgd", w, np.asarray(o[:live[row], row], np.float64)) / w.sum(0)[..., None]
        np.testing.assert_allclose(np.asarray(got[row, 0]), want.reshape(-1, o.shape[-1]), rtol=1e-5, atol=1e-6,
                                   err_msg=f"seed {seed}: row {row}")


def test_fold_splits_over_many_steps_and_column_blocks_keep_the_bits():
    """40 splits (three of the fold's loop steps of 16, the last partial), a row whose live splits end mid-step, empty
    splits: one call equals the same splits folded in two calls, and in calls of 1, 2, 5 and 32 splits (loop steps of
    1, 2, 8 and 16 splits: a call loads as many a step as it has) (bits), and the float64 softmax merge. Each
    (sequence, KV head) folded by 1, 2 or 4 programs, each over a part of D (the default on a GPU where few
    (sequence, KV head)s fold, as in batch-1 decode): the same bits, from the empty state and continuing one (each
    block reads its columns of acc); a count that does not divide D into blocks of >= 16 is refused."""
    seed = 4103
    rng = np.random.default_rng(seed)
    o = jnp.asarray(rng.standard_normal((40, 2, 2, 3, 64)), jnp.float32)
    lse = np.asarray(4 * rng.standard_normal((40, 2, 2, 3)), np.float32)
    lse[rng.random(lse.shape) < 0.1] = -np.inf
    live, state = np.array([40, 23]), pk.empty_state(2, 1, 6, 64)
    one = pk.fold_splits(state, o, jnp.asarray(lse), jnp.asarray(live), column_blocks=1)
    for cuts in ((17,), (1, 3, 8)):
        pieces = state
        for start, end in zip((0, *cuts), (*cuts, 40)):
            pieces = pk.fold_splits(pieces, o[start:end], jnp.asarray(lse[start:end]),
                                    jnp.asarray(np.clip(live - start, 0, end - start)))
        assert all(np.array_equal(x, y) for x, y in zip(one, pieces)), f"seed {seed}: calls cut at {cuts}"
    _assert_fold_is_the_float64_merge(one, o, lse, live, seed)
    four = pk.fold_splits(state, o, jnp.asarray(lse), jnp.asarray(live), column_blocks=4)
    assert all(np.array_equal(x, y) for x, y in zip(one, four)), f"seed {seed}: 4 column blocks"
    start = pk.fold_splits(state, o[:17], jnp.asarray(lse[:17]), jnp.asarray(np.minimum(live, 17)))
    two = pk.fold_splits(start, o[17:], jnp.asarray(lse[17:]), jnp.asarray(live - 17), column_blocks=2)
    assert all(np.array_equal(x, y) for x, y in zip(one, two)), f"seed {seed}: a continued state, 2 column blocks"
    with pytest.raises(ValueError, match="column_blocks=8; allowed"):
        pk.fold_splits(state, o, jnp.asarray(lse), jnp.asarray(live), column_blocks=8)


def test_decode_split_lens_follow_the_length_alone():
    """Keys per split of the engine's decode by a sequence's length L: the power of two at or below ceil(L / 16),
    within 512..4,096 (Python integers as the reference), for every L up to 140,000 (so 16 to 32 splits from 8K to
    128K); `max_decode_splits` is the most splits of any length up to its argument."""
    lengths = np.arange(140_001)
    got = np.asarray(pk.decode_split_lens(jnp.asarray(lengths, jnp.int32)))
    want = np.array([min(max(1 << (max(-(-n // 16), 1).bit_length() - 1), 512), 4096) for n in range(lengths.size)])
    wrong = np.flatnonzero(got != want)
    assert not wrong.size, f"lengths {lengths[wrong[:5]]}: {got[wrong[:5]]}, want {want[wrong[:5]]}"
    assert [pk.decode_split_len(n) for n in range(0, 140_001, 97)] == want[::97].tolist()
    most = np.maximum.accumulate(-(-lengths // want))
    splits = -(-lengths[8192:131073] // want[8192:131073])
    assert splits.min() == 16 and splits.max() == 32, (splits.min(), splits.max())
    for max_len in (1, 511, 8192, 8193, 9000, 16368, 16369, 65520, 65536, 70000, 131072, 140_000):
        assert pk.max_decode_splits(max_len) == most[max_len], f"max_len {max_len}"


def test_paged_decode_state_is_batch_invariant_and_equals_pieces():
    """Fixed 64-key splits over a pool that keeps a page's keys then its values (the one-pool form: the store and
    the page cache) and over two pools: a sequence alone (a narrow table) gets the bits it gets in a batch (a wider
    one, other programs), one program a sequence the same, the two-pool form the same, and `decode_state` over its
    keys in two pieces the same, as offloaded blocks arrive (what `attention.attend_rows_many` and the offloaded
    decode rely on); and o within bf16 tolerance of the XLA reference."""
    seed = 4100
    rng = np.random.default_rng(seed)
    batch, hq, hkv, d, page, split = 3, 4, 2, 32, 64, 64
    lengths = np.array([100, 300, 31])
    kv = jnp.asarray(rng.standard_normal((20, 2, page, hkv, d)), jnp.bfloat16)
    tables = np.zeros((batch, 6), np.int32)
    order = rng.permutation(20)
    for b, start in zip(range(batch), (0, 6, 12)):
        used = -(-lengths[b] // page)
        tables[b, :used] = order[start:start + used]
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), jnp.bfloat16)
    empty = pk.empty_state(batch, 1, hq, d)
    together = pk.paged_decode_state_kv(q, kv, tables, lengths, empty, split_len=split, num_programs=3)
    # One program a sequence, the fold chosen by default (on a GPU inside the attention kernel, here the fold kernel).
    one_program = pk.paged_decode_state_kv(q, kv, tables, lengths, empty, split_len=split, num_programs=1)
    assert all(np.array_equal(x, y) for x, y in zip(together, one_program)), f"seed {seed}: one program"
    two_pools = pk.paged_decode_state(q, kv[:, 0], kv[:, 1], tables, lengths, empty, split_len=split)
    assert all(np.array_equal(x, y) for x, y in zip(together, two_pools)), f"seed {seed}: two pools"
    for b in range(batch):
        used = -(-lengths[b] // page)
        alone = pk.paged_decode_state_kv(q[b:b + 1], kv, tables[b:b + 1, :used], lengths[b:b + 1],
                                         pk.empty_state(1, 1, hq, d), split_len=split)
        assert all(np.array_equal(x[b], y[0]) for x, y in zip(together, alone)), f"seed {seed}: sequence {b}"
        keys = kv[tables[b], 0].reshape(1, -1, hkv, d)
        values = kv[tables[b], 1].reshape(1, -1, hkv, d)
        state = pk.empty_state(1, 1, hq, d)
        for lo, hi in ((0, 128), (128, 384)):  # streamed in two pieces, as offloaded blocks arrive
            state = pk.decode_state(q[b:b + 1], keys[:, lo:hi], values[:, lo:hi], state,
                                    kv_len=int(np.clip(lengths[b] - lo, 0, hi - lo)), split_len=split)
        assert all(np.array_equal(x[b], y[0]) for x, y in zip(together, state)), f"seed {seed}: pieces {b}"
        o, _ = pk.finish_state(alone)
        ref = pk.paged_decode_attention_with_lse_xla(q[b:b + 1].astype(jnp.float32), kv[:, 0].astype(jnp.float32),
                                                     kv[:, 1].astype(jnp.float32), tables[b:b + 1],
                                                     lengths[b:b + 1])[0]
        assert float(jnp.abs(o[:, 0] - ref).max()) < 2e-2, f"seed {seed}: sequence {b}"


def test_paged_decode_state_folded_in_kernel_is_the_fold_kernels_state():
    """One program a (sequence, KV head) folding each split as soon as it has attended it (`fold_in_kernel`, the
    default on a GPU where one program walks a sequence's splits) continues a state as the split states and the fold
    kernel do (tested against float64 in test_fold_splits_*): the same bits on a GPU, where Triton compiles the same
    operations either way; in the CPU interpreter, whose bits follow the surrounding program, within float32
    rounding (it defaults to the fold kernel there). The two-pool and the one-pool (offloaded store's) forms; a
    sequence with no key leaves its state as it was."""
    seed = 4105
    rng = np.random.default_rng(seed)
    batch, hq, hkv, d, page, split = 4, 4, 2, 32, 32, 64
    lengths = np.array([100, 300, 31, 0])
    kv = jnp.asarray(rng.standard_normal((40, 2, page, hkv, d)), jnp.bfloat16)
    tables = np.zeros((batch, 10), np.int32)
    for b in range(batch):
        tables[b, :-(-lengths[b] // page)] = rng.permutation(40)[:-(-lengths[b] // page)]
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), jnp.bfloat16)
    # A state that already holds keys, as the offloaded decode's does after its host blocks.
    start = pk.paged_decode_state(q, kv[:, 0], kv[:, 1], np.roll(tables, 1, axis=0), np.roll(lengths, 1),
                                  pk.empty_state(batch, 1, hq, d), split_len=split)
    on_gpu = jax.default_backend() == "gpu"
    runs = {"two pools": lambda **kw: pk.paged_decode_state(q, kv[:, 0], kv[:, 1], tables, lengths, start,
                                                            split_len=split, **kw),
            "one pool": lambda **kw: pk.paged_decode_state_kv(q, kv, tables, lengths, start, split_len=split, **kw)}
    for name, run in runs.items():
        folded = run(fold_in_kernel=True)
        kernel = run(num_programs=1, fold_in_kernel=False)
        for x, y, part in zip(folded, kernel, ("acc", "m", "l")):
            if on_gpu:
                assert np.array_equal(x, y), f"seed {seed}: {name}, {part}"
            else:
                np.testing.assert_allclose(x, y, rtol=4e-6, atol=1e-6, err_msg=f"seed {seed}: {name}, {part}")
        assert all(np.array_equal(x[3], y[3]) for x, y in zip(folded, start)), f"seed {seed}: {name}, no key"
    with pytest.raises(ValueError, match="num_programs=3 with fold_in_kernel=True; allowed"):
        runs["two pools"](fold_in_kernel=True, num_programs=3)


def test_paged_decode_splits_by_each_sequences_length():
    """By default each sequence's splits follow its own whole length: 2,100 keys that are the last piece of a
    sequence of 16,421 (`total_lens`) split by 1,024, 600 keys of their own by 512. Together, alone, and in pieces
    (`decode_state` over the first 1,024 keys, then the pool's rest, each told the whole length) the same bits; told
    only their own length, the 2,100 keys split by 512 and their bits change."""
    seed = 4120
    rng = np.random.default_rng(seed)
    hq, hkv, d, page = 2, 1, 32, 512
    lengths, totals = np.array([2100, 600]), np.array([16421, 600])
    assert pk.decode_split_lens(jnp.asarray(totals)).tolist() == [1024, 512]
    kv = jnp.asarray(rng.standard_normal((8, 2, page, hkv, d)), jnp.bfloat16)
    order = rng.permutation(8).astype(np.int32)
    tables = np.stack([order[:5], np.pad(order[5:7], (0, 3))])
    q = jnp.asarray(rng.standard_normal((2, hq, d)), jnp.bfloat16)
    empty = pk.empty_state(1, 1, hq, d)
    together = pk.paged_decode_state_kv(q, kv, tables, lengths, pk.empty_state(2, 1, hq, d), total_lens=totals,
                                        num_programs=3)
    for b in range(2):
        alone = pk.paged_decode_state_kv(q[b:b + 1], kv, tables[b:b + 1], lengths[b:b + 1], empty,
                                         total_lens=totals[b:b + 1])
        assert all(np.array_equal(x[b], y[0]) for x, y in zip(together, alone)), f"seed {seed}: sequence {b}"
    first = kv[tables[0, :2]]
    state = pk.decode_state(q[:1], first[:, 0].reshape(1, -1, hkv, d), first[:, 1].reshape(1, -1, hkv, d), empty,
                            total_len=int(totals[0]))
    rest = pk.paged_decode_state_kv(q[:1], kv, tables[:1, 2:], lengths[:1] - 1024, state, total_lens=totals[:1])
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(together, rest)), f"seed {seed}: pieces"
    own = pk.paged_decode_state_kv(q[:1], kv, tables[:1], lengths[:1], empty)
    assert not np.array_equal(own.acc[0], together.acc[0]), f"seed {seed}: 512-key splits gave 1,024-key bits"


@pytest.mark.parametrize("num_queries", [1, 20])
def test_xla_twin_gives_each_batch_row_its_bits_alone(num_queries):
    """The jnp attention twin runs batch rows one after another, as the kernels give each row programs of its own:
    the offloaded engine attends all its requests' tails in one call (`pooled_decode_end`). Batched, XLA's CPU sums
    and dots changed nearly every row's float32 state with the batch size (issue 63)."""
    seed = 4400 + num_queries
    rng = np.random.default_rng(seed)
    batch, hq, hkv, d, keys = 5, 4, 2, 32, 512
    q = jnp.asarray(rng.standard_normal((batch, num_queries, hq, d)), jnp.bfloat16)
    k0, v0, k, v = (jnp.asarray(rng.standard_normal((batch, keys, hkv, d)), jnp.bfloat16) for _ in range(4))
    lengths = np.array([1, 300, keys, 17, 129], np.int32)
    # Continued from a state over earlier keys, as the tail continues the host blocks' state.
    start = pk.attention_state_xla(q, k0, v0)
    together = pk.attention_state_xla(q, k, v, start, kv_len=lengths)
    for b in range(batch):
        row = pk.AttentionState(*(x[b:b + 1] for x in start))
        alone = pk.attention_state_xla(q[b:b + 1], k[b:b + 1], v[b:b + 1], row, kv_len=lengths[b:b + 1])
        assert all(np.array_equal(x[b], y[0]) for x, y in zip(together, alone)), f"seed {seed}: row {b}"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the default mode's CPU guarantee (XLA's CPU dot); on a "
                    "GPU cuBLAS picks its order by row count and the batch-invariant mode gives it")
def test_decode_rows_multiply_as_each_alone():
    """A decode step's rows (one token of each sequence) get from the layer's matmuls and the LM head the bits each
    gets alone, at a width where XLA's CPU backend multiplies one row and several by different kernels (before: of 8
    rows together, 1 differed from itself alone after the MLP and 2 in the LM head, issue 63)."""
    seed = 4500
    rng = np.random.default_rng(seed)
    hidden, inter, hq, hkv, d, vocab, batch = 512, 1024, 8, 2, 64, 4096, 8
    cfg = ModelConfig("llama", vocab, hidden, inter, 1, hq, hkv, d, 1e-6, 4096, RopeConfig(10000.0), False, False,
                      False)

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.bfloat16)

    layer = LayerParams(attn_norm=weight(hidden) + 1, wqkv=weight(hidden, (hq + 2 * hkv) * d), bqkv=None, q_norm=None,
                        k_norm=None, wo=weight(hq * d, hidden), mlp_norm=weight(hidden) + 1,
                        w_gate_up=weight(hidden, 2 * inter), w_down=weight(inter, hidden))
    params = ModelParams(embed=weight(vocab, hidden), layers=[layer], final_norm=weight(hidden) + 1,
                         lm_head=weight(hidden, vocab))
    x = jnp.asarray(rng.standard_normal((batch, 1, hidden)), jnp.bfloat16)
    attn = jnp.asarray(rng.standard_normal((batch, 1, hq, d)), jnp.float32)
    qkv = step_jit(lambda x: decoder.project_qkv(cfg, layer, x))
    mlp = step_jit(lambda x, attn: decoder.attention_output_and_mlp(cfg, layer, x, attn))
    head = step_jit(lambda h: decoder.logits(cfg, params, h))
    together = qkv(x), mlp(x, attn), head(x[:, 0])
    for b in range(batch):
        alone = qkv(x[b:b + 1]), mlp(x[b:b + 1], attn[b:b + 1]), head(x[b, 0])  # the head: one row as [hidden]
        for name, many, one in zip(("q, k, v", "attention output and MLP", "LM head"), together, alone):
            assert all(np.array_equal(_bits(m[b]), _bits(o if name == "LM head" else o[0]))
                       for m, o in zip(jax.tree.leaves(many), jax.tree.leaves(one))), f"seed {seed}: {name}, row {b}"


MODEL_SEED, PROMPT_SEED = 4201, 4202


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    tiny_models.build("qwen3", path, seed=MODEL_SEED)
    rng = np.random.default_rng(PROMPT_SEED)
    lengths = [5, 700, 37, 260, 12, 530]  # and 90, 400, 150, 64 until the suite needed the time (2026-11-27, 45eb088)
    return path, [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in lengths]


def test_seeded_alone_and_together_give_the_same_tokens(tiny_qwen3):
    """Six prompts of 5..700 tokens, seeded sampling (the greedy paths, offloaded and cached included, are
    `test_each_architecture_alone_together_offloaded_cached`'s): each alone == all together."""
    path, prompts = tiny_qwen3
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)
    # The default config: batch-invariant on a GPU (Pallas kernels); the CPU's XLA twins hold it as they are.
    gpu = LLM(path, dtype="bfloat16", max_model_len=1024, max_num_seqs=len(prompts))
    alone = [gpu.generate([p], sampling)[0].token_ids for p in prompts]
    assert [o.token_ids for o in gpu.generate(prompts, sampling)] == alone, \
        f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}"


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "qwen3"])
def test_each_architecture_alone_together_offloaded_cached(tmp_path_factory, variant):
    """Tiny Llama, Qwen2 and Qwen3 in bfloat16, three prompts of 5..700 tokens, 12 greedy tokens: alone == together
    == offloaded (one at a time and together) == together after their first halves were sent first (prefix
    caching: each prompt past one block reads its first 256 keys from the cache)."""
    seed = MODEL_SEED + len(variant)
    path = tiny_models.build_in(tmp_path_factory, variant, seed)
    rng = np.random.default_rng(PROMPT_SEED)
    prompts = [rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (5, 530, 700)]
    where = f"{variant}, model seed {seed}, prompt seed {PROMPT_SEED}"
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_model_len=1024)  # the default config otherwise (batch-invariant)
    gpu = LLM(path, max_num_seqs=len(prompts), **kw)
    alone = [gpu.generate([p], sampling)[0].token_ids for p in prompts]
    assert [o.token_ids for o in gpu.generate(prompts, sampling)] == alone, f"{where}: together"
    off = LLM(path, offload=True, block_size=256, prefill="layerwise", **kw)
    assert [off.generate([p], sampling)[0].token_ids for p in prompts] == alone, f"{where}: offloaded"
    assert [o.token_ids for o in off.generate(prompts, sampling)] == alone, f"{where}: offloaded together"
    cached = LLM(path, max_num_seqs=len(prompts), enable_prefix_caching=True, **kw)
    cached.generate([p[: len(p) // 2] for p in prompts], SamplingParams(temperature=0.0, max_tokens=1))
    outs = cached.generate(prompts, sampling)
    assert [o.num_cached_tokens for o in outs] == [0, 256, 256], where
    assert [o.token_ids for o in outs] == alone, f"{where}: after cached halves"


def test_prompt_tokens_take_one_pass_and_generated_tokens_the_chunks(tmp_path_factory, monkeypatch):
    """Which order each path's layer matmuls take, recorded as their programs are traced (Pallas kernels, interpret
    mode; the tiny models' K is below K_CHUNK, so the two orders' bits agree and only this test tells the paths
    apart): a prompt's tokens (more than 2 rows here) one pass over K, generated tokens (at most 2: max_num_seqs)
    K's chunks. In GPU memory: packed prefill, decode steps, chunk steps that also decode (their chunk's rows and
    decode rows multiplied apart), the one-request prefill (`LLM.logits`); offloaded: one request (prefill in chunks,
    layerwise) and two (the batch engine's offloaded prefill and pooled decode). Not traced here: the one-request
    in-GPU decode, XAttention's chunk layer, CacheBlend, several decode steps a program, tensor parallelism."""
    path = tiny_models.build_in(tmp_path_factory, "llama3", MODEL_SEED)
    calls: list[tuple[int, bool]] = []
    real = decoder.matmul

    def spy(x, w, **kw):
        if "one_pass" in kw:  # a layer's matmul (the LM head passes no order)
            calls.append((int(np.prod(x.shape[:-1])), kw["one_pass"]))
        return real(x, w, **kw)

    monkeypatch.setattr(decoder, "matmul", spy)
    rng = np.random.default_rng(PROMPT_SEED)
    short, other, long = (rng.integers(3, tiny_models.VOCAB, size=n).tolist() for n in (29, 37, 140))
    kw = dict(dtype="float32", attention_impl="pallas", batch_invariant=True, max_model_len=256, max_num_seqs=2)
    three = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def traced(run, where: str, phases: set[bool] = frozenset({True, False})) -> list[tuple[int, bool]]:
        """The (rows, one_pass) of the layer matmuls in the programs `run` traced (`phases`: the orders it traces
        programs of); each in its phase's order."""
        calls.clear()
        run()
        assert {p for _, p in calls} == phases, f"{where}: traced {sorted(set(calls))}"
        wrong = sorted({(rows, p) for rows, p in calls if p != (rows > 2)})
        assert not wrong, f"{where}: (rows, one_pass) {wrong} in the other phase's order"
        return list(calls)

    jax.clear_caches()  # programs traced before (by earlier tests, by another engine here) would not reach the spy
    batch = LLM(path, max_num_batched_tokens=128, **kw)
    traced(lambda: batch.generate([short], three), "packed prefill, decode")
    chunk_step = traced(lambda: batch.generate([short, long], three), "chunk steps beside a decode")
    assert max(rows for rows, _ in chunk_step) <= 128, "a chunk step multiplied its chunk and decode rows as one"
    calls.clear()
    batch.logits(other)
    assert calls and all(p for _, p in calls), "the one-request prefill multiplied in chunks"
    for prefill_mode in ("chunked", "layerwise"):
        jax.clear_caches()
        with pytest.warns(UserWarning, match="block_size 16: offloaded decode gives the in-GPU bits only with a "
                                             "multiple of 512"):
            off = LLM(path, offload=True, block_size=16, num_ring_slots=2, prefill=prefill_mode, **kw)
        traced(lambda: off.generate([short], three), f"offloaded {prefill_mode}, one request")
        if prefill_mode == "chunked":
            # Its prefill reuses the one-request programs (same shapes); the pooled decode is new.
            traced(lambda: off.generate([short, other], three), "offloaded, two requests", {False})
