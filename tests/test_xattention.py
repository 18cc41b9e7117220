"""XAttention prefill in the engine: threshold 1 is full prefill in every mode, the offloaded chunked path makes
the in-GPU path's choices, moving each earlier block once a layer, the query-chunked estimate and the top-fraction
selection, and the options' errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams
from jax_offload.offload_runner import compiles_ahead
from jax_offload.sparse import xattention
from jax_offload.sparse.xattention import XAttention

MODEL_SEED = 701
PROMPT_SEED = 702
XATTN = dict(prefill_policy="xattention", xattn_stride=4, xattn_block=16)
OFFLOAD = dict(offload=True, block_size=64, num_ring_slots=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    tiny_models.build("llama3", path, seed=MODEL_SEED)
    return path


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(PROMPT_SEED).integers(3, tiny_models.VOCAB, size=300).tolist()


@pytest.fixture(scope="module")
def full_logits(model_dir, prompt):
    return LLM(model_dir, dtype="float32").logits(prompt)


@pytest.mark.parametrize("mode", [{}, dict(OFFLOAD, prefill="chunked"), dict(OFFLOAD, prefill="layerwise")],
                         ids=["in_gpu", "offload_chunked", "offload_layerwise"])
def test_threshold_one_is_full_prefill(model_dir, prompt, full_logits, mode):
    """Threshold 1 keeps every visible block: the block-sparse path gives full attention's logits."""
    llm = LLM(model_dir, dtype="float32", xattn_threshold=1.0, **XATTN, **mode)
    diff = np.abs(llm.logits(prompt) - full_logits).max()
    assert diff <= 1e-5, f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}: max |dlogit| {diff}"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.prefill_density == [1.0] * llm.model_config.num_layers


def test_offloaded_chunks_choose_as_in_gpu(model_dir, prompt, full_logits):
    """A chunk estimated against the earlier blocks streamed from the host selects what the whole-prompt estimate
    selects for those queries: same logits, same densities; and the selection is really sparse."""
    in_gpu = LLM(model_dir, dtype="float32", xattn_threshold=0.6, **XATTN)
    chunked = LLM(model_dir, dtype="float32", xattn_threshold=0.6, **XATTN, **OFFLOAD, prefill="chunked")
    diff = np.abs(chunked.logits(prompt) - in_gpu.logits(prompt)).max()
    assert diff <= 1e-5, f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}: max |dlogit| {diff}"
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    dense_in_gpu = in_gpu.generate([prompt], greedy)[0].prefill_density
    dense_chunked = chunked.generate([prompt], greedy)[0].prefill_density
    # In-GPU counts the blocks of every query block; chunked ones count the same pairs chunk by chunk.
    np.testing.assert_allclose(dense_chunked, dense_in_gpu, rtol=1e-6)
    assert max(dense_in_gpu) < 0.9, dense_in_gpu
    assert np.abs(in_gpu.logits(prompt) - full_logits).max() > 1e-3  # sparse is not full


def test_offloaded_chunks_in_bfloat16_equal_in_gpu(model_dir, prompt):
    """bfloat16, the dtype users run: a chunk's one choice and one attention call over its keys give the in-GPU
    whole-prompt XAttention's logits to the bit, and its greedy tokens. Batch-invariant: on a GPU the default mode's
    projections over a chunk's rows and over the whole prompt's may round differently (one row of 300 differed by
    one bf16 step on an H200, bench/results/runs/h200_xattn_chunk/); on the CPU the mode changes nothing."""
    xattn = dict(XATTN, xattn_threshold=0.6, batch_invariant=True)
    in_gpu = LLM(model_dir, dtype="bfloat16", **xattn)
    chunked = LLM(model_dir, dtype="bfloat16", **xattn, **OFFLOAD, prefill="chunked")
    where = f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}"
    np.testing.assert_array_equal(chunked.logits(prompt), in_gpu.logits(prompt), err_msg=where)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert chunked.generate([prompt], greedy)[0].token_ids == in_gpu.generate([prompt], greedy)[0].token_ids, where


_COMPILES_AHEAD = """
import json, sys, threading
from jax._src import dispatch, monitoring
from jax_offload import LLM
model_dir, prompt, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
compiled_on = []

def listen(event, seconds, fun_name="", **_):
    if event == dispatch.BACKEND_COMPILE_EVENT and "xattn_chunk_layer" in fun_name:
        compiled_on.append(threading.current_thread().name)

llm = LLM(model_dir, dtype="float32", **options)
monitoring.register_event_duration_secs_listener(listen)
llm.logits(prompt)
for future in llm._runner.span_compiles.values():
    future.result()  # raises what the thread's compile raised
print(json.dumps(dict(spans=list(llm._runner.span_compiles), began=llm._runner.span_compile_chunks,
                      compiled_on=sorted(compiled_on))))
"""


def test_next_key_span_compiles_ahead(model_dir, prompt):
    """A chunked prefill compiles its chunk program for the next key span on a thread from the second chunk of this
    span on, while this span's chunks run: the chunk that reaches it finds it compiled, so the prefill's thread
    compiles the program once (its first span). On the CPU only when asked (`compiles_ahead`), and here in a process
    of its own, so that no test process of the suite keeps a compiling thread."""
    # 32-token chunks (no other test's): spans of 256 keys for chunks 0-7, then 512 for chunks 8 and 9.
    options = dict(xattn_threshold=0.6, **XATTN, **dict(OFFLOAD, block_size=32), prefill="chunked")
    run = subprocess.run([sys.executable, "-c", _COMPILES_AHEAD, str(model_dir), json.dumps(prompt),
                          json.dumps(options)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAX_OFFLOAD_COMPILE_AHEAD="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["spans"] == [512] and got["began"] == {"512": 1}, got  # the second chunk, not the last of span 256
    assert got["compiled_on"] == ["MainThread", "jax_offload-span-compile_0"], got


def test_no_compile_ahead_on_the_cpu_unless_asked(model_dir, prompt, monkeypatch):
    """The CPU backend compiles every span's chunk program on the prefill's thread; a bad setting is one clear error."""
    monkeypatch.delenv("JAX_OFFLOAD_COMPILE_AHEAD", raising=False)
    llm = LLM(model_dir, dtype="float32", xattn_threshold=0.6, **XATTN, **dict(OFFLOAD, block_size=32),
              prefill="chunked")
    llm.logits(prompt)
    assert llm._runner.span_compiles == {}
    monkeypatch.setenv("JAX_OFFLOAD_COMPILE_AHEAD", "yes")
    with pytest.raises(ValueError, match="JAX_OFFLOAD_COMPILE_AHEAD is 'yes'; allowed: 0 or 1"):
        compiles_ahead()


def test_sparse_chunks_move_each_earlier_block_once(model_dir, prompt):
    """A chunk streams each earlier block once a layer, into the GPU buffers its estimate and attention read: the
    bytes of full chunked prefill, while the attention is sparse."""
    small_blocks = dict(OFFLOAD, block_size=16, prefill="chunked")
    full = LLM(model_dir, dtype="float32", **small_blocks)
    sparse = LLM(model_dir, dtype="float32", xattn_threshold=0.3, **XATTN, **small_blocks)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    full.generate([prompt], greedy)
    density = sparse.generate([prompt], greedy)[0].prefill_density
    full_bytes, sparse_bytes = full._runner.last_prefill_pcie_bytes, sparse._runner.last_prefill_pcie_bytes
    assert full_bytes > 0
    assert sparse_bytes == full_bytes, (full_bytes, sparse_bytes)
    assert max(density) < 0.9, density


def test_offloaded_xattention_prefills_layerwise_unless_told(model_dir):
    """Offloaded XAttention prefills layerwise (no earlier block read back) unless told to chunk."""
    assert LLM(model_dir, dtype="float32", **XATTN, **OFFLOAD).engine_config.prefill == "layerwise"
    assert LLM(model_dir, dtype="float32", **XATTN, **OFFLOAD, prefill="chunked").engine_config.prefill == "chunked"
    assert LLM(model_dir, dtype="float32", **OFFLOAD).engine_config.prefill == "chunked"


def test_with_quest_decode(model_dir, prompt):
    """Both policies at settings that keep everything: full prefill and full decode's tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = LLM(model_dir, dtype="float32", **OFFLOAD).generate([prompt], greedy)[0].token_ids
    both = LLM(model_dir, dtype="float32", xattn_threshold=1.0, decode_policy="quest", decode_budget=1024,
               dense_layers=1, **XATTN, **OFFLOAD).generate([prompt], greedy)[0].token_ids
    assert both == full


def test_sparse_chunks_with_a_page_policy(model_dir, prompt):
    """A page policy keeps its sparse layers as one buffer each, from which a chunk's earlier blocks are read: the
    chunks' logits equal those of the same prefill with blocks kept one by one."""
    sparse = dict(XATTN, xattn_density=0.3, offload=True, block_size=16, num_ring_slots=8, prefill="chunked")
    blocks = LLM(model_dir, dtype="float32", **sparse)
    pages = LLM(model_dir, dtype="float32", decode_policy="sketch", decode_budget=1024, page_size=16,
                dense_layers=1, **sparse)
    diff = np.abs(pages.logits(prompt) - blocks.logits(prompt)).max()
    assert diff <= 1e-5, f"model seed {MODEL_SEED}, prompt seed {PROMPT_SEED}: max |dlogit| {diff}"


def test_query_chunked_estimate_equals_one_call(monkeypatch):
    seed = 703
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, 256, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 256, 2, 32)), jnp.float32)
    policy = XAttention(threshold=0.7, stride=4, block=16)
    whole = xattention.select(policy, "xla", q, k, q_offset=0, kv_len=250)
    monkeypatch.setattr(xattention, "SCORE_BYTES", 32 * 4 * 64 * 4 // 4)  # 32 query rows (two blocks) a call
    assert xattention._query_chunk(policy, 4, 256) == 32
    chunked = xattention.select(policy, "xla", q, k, q_offset=0, kv_len=250)
    np.testing.assert_array_equal(np.asarray(chunked), np.asarray(whole), err_msg=f"seed {seed}")


def test_top_fraction_keeps_that_share_of_each_row():
    seed = 704
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, 320, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 320, 2, 32)), jnp.float32)
    policy = XAttention(stride=4, block=16, top_fraction=0.25)
    mask = np.asarray(xattention.select(policy, "xla", q, k, q_offset=0, kv_len=320))[0]
    nqb = mask.shape[1]
    for i in range(nqb):
        visible = i + 1
        forced = {0, i}
        want = max(int(np.ceil(0.25 * visible)), len(forced))
        for h in range(4):
            row = np.flatnonzero(mask[h, i])
            assert set(forced) <= set(row) and len(row) == want and row.max() <= i, (seed, h, i, row)


def test_highest_first_marks_what_a_stable_sort_ranks_first():
    """The top-fraction choice's count largest of a row (ties to the lower index), found without sorting, against the
    ranks of NumPy's stable descending sort: rows with ties, negatives, zeros, counts <= 0 and past the row."""
    seed = 705
    rng = np.random.default_rng(seed)
    score = rng.choice(np.float32([-1.0, -0.0, 0.0, 1e-30, 0.25, 0.5, 0.5000001, 3.0]), size=(6, 9, 40))
    score[0] = rng.standard_normal((9, 40)).astype(np.float32)  # no ties
    count = rng.integers(-2, 44, size=(6, 9)).astype(np.int32)
    rank = np.argsort(np.argsort(-score, axis=-1, kind="stable"), axis=-1, kind="stable")
    expected = rank < count[..., None]
    got = np.asarray(xattention.highest_first(jnp.asarray(score), jnp.asarray(count)))
    np.testing.assert_array_equal(got, expected, err_msg=f"seed {seed}")


@pytest.mark.parametrize("kwargs,message", [
    (dict(prefill_policy="sparse"), "prefill_policy 'sparse' is unknown; valid: full, xattention"),
    (dict(xattn_threshold=0.9), "xattn_threshold applies only with prefill_policy='xattention'"),
    (dict(prefill_policy="xattention", xattn_threshold=1.5), r"xattn_threshold must be a number in \(0, 1\]"),
    (dict(prefill_policy="xattention", xattn_block=48), "xattn_block must be a power of two >= 16"),
    (dict(xattn_density=0.05), "xattn_density applies only with prefill_policy='xattention'"),
    (dict(prefill_policy="xattention", xattn_density=0), r"xattn_density must be a number in \(0, 1\]"),
    (dict(prefill_policy="xattention", xattn_density=0.05, xattn_threshold=0.9), "give one"),
    (dict(prefill_policy="xattention", xattn_stride=3), "xattn_stride must be a power of two that divides"),
    (dict(prefill_policy="xattention", xattn_block=128, offload=True, block_size=64),
     "xattn_block 128 must divide block_size 64"),
])
def test_bad_xattention_options(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, dtype="float32", **kwargs)
