"""The page-choosing decode policies over the offloaded KV (sketch and Quest): Quest's page choice against a float64
reference, and for both exactness at full budget, the Pallas path against the jnp path, the bytes a step moves,
the metadata's size, the sketch written with every stored block, and no state across requests."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams
from jax_offload.serving.engine import run_requests
from jax_offload.sparse.quest import TOP_K_CHUNK, page_bounds, page_rows, select_pages, top_k
from pallas_kernels import mgpu_sketch, top_k_ascending
from pallas_kernels.top_k import ROW_MAX
from pallas_kernels._common import on_hopper
from pallas_kernels.sketch import runs_on_hopper_kernel

MODEL_SEED = 501
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def quest_reference(q, k, num_pages, budget_pages, page_size):
    """float64: per KV head the sink page and the highest GQA-max bounds among the written pages, ascending
    (ties to the lower page); missing entries (fewer pages than the budget) are num_slots."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    t, hkv, d = k.shape
    num_slots = t // page_size
    pages = k.reshape(num_slots, page_size, hkv, d)
    kmin, kmax = pages.min(1).transpose(1, 0, 2), pages.max(1).transpose(1, 0, 2)  # [Hkv, P, D]
    qg = q.reshape(hkv, -1, d)
    out = np.full((hkv, budget_pages), num_slots, np.int64)
    for h in range(hkv):
        bound = np.maximum(qg[h][:, None] * kmin[h][None], qg[h][:, None] * kmax[h][None]).sum(-1).max(0)
        candidates = sorted(range(1, num_pages), key=lambda p: (-bound[p], p))
        chosen = sorted([0] + candidates[: budget_pages - 1])[:budget_pages]
        out[h, : len(chosen)] = chosen
    return out


@pytest.mark.parametrize("n,k", [(TOP_K_CHUNK * 3, 256), (TOP_K_CHUNK * 32, 256), (TOP_K_CHUNK * 8, 512),
                                 (TOP_K_CHUNK * 4, 1), (TOP_K_CHUNK, 256)])
def test_top_k_in_stages_equals_one_top_k_over_the_row(n, k):
    # Few distinct values, so many ties cross the chunks' borders; +inf and -inf as top_pages writes them.
    seed = n + k
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, size=(3, n)).astype(np.float32)
    x[:, rng.integers(0, n, 5)] = np.inf
    x[:, rng.integers(0, n, n // 4)] = -np.inf
    values, index = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    ref = np.stack([np.lexsort((np.arange(n), -row))[:k] for row in x])  # value descending, then index ascending
    np.testing.assert_array_equal(np.asarray(index), ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, ref, -1), err_msg=f"seed {seed}")


@pytest.mark.parametrize("rows,n,k,dtype", [(3, 100, 7, np.float32), (2, 256, 256, np.float32),
                                             (4, 2048, 64, np.int32), (2, 2 * ROW_MAX, 256, np.float32)])
def test_top_k_ascending_kernel_equals_a_stable_sort(rows, n, k, dtype):
    # Few distinct values (ties everywhere, also across the two stages' chunks), +-inf and -0.0 for floats.
    seed = 700 + n + k
    rng = np.random.default_rng(seed)
    x = rng.integers(-20, 20, size=(rows, n)).astype(dtype)
    if dtype == np.float32:
        x[:, rng.integers(0, n, 3)] = np.inf
        x[:, rng.integers(0, n, n // 4)] = -np.inf
        x[(x == 0) & (rng.random(x.shape) < 0.5)] = -0.0  # equal to +0.0
    got = np.asarray(top_k_ascending(jnp.asarray(x), k, interpret=True))
    ref = np.sort(np.stack([np.lexsort((np.arange(n), -row.astype(np.float64)))[:k] for row in x]), axis=-1)
    np.testing.assert_array_equal(got, ref, err_msg=f"seed {seed}")


@pytest.mark.parametrize("hq,hkv,num_pages,budget", [(8, 2, 40, 8), (4, 4, 40, 40), (6, 3, 5, 8), (8, 1, 33, 1)])
def test_selected_pages_match_float64(hq, hkv, num_pages, budget):
    seed = 600 + hq * 10 + num_pages
    rng = np.random.default_rng(seed)
    page_size, d = 16, 32
    k = rng.standard_normal((40 * page_size, hkv, d)).astype(np.float32)
    q = rng.standard_normal((hq, d)).astype(np.float32)
    kmin, kmax = page_bounds(jnp.asarray(k), page_size)
    got = np.asarray(select_pages(jnp.asarray(q), kmin, kmax, jnp.int32(num_pages), budget))
    np.testing.assert_array_equal(got, quest_reference(q, k, num_pages, budget, page_size), err_msg=f"seed {seed}")


def test_page_rows_address_each_heads_pages():
    """Rows of a paged layer [blocks, Hkv, units, 2, 16, D]: page p of head h holds its keys, in order."""
    hkv, block_size, page_size, blocks = 3, 64, 32, 4
    layer = np.arange(blocks * hkv * (block_size // 16)).reshape(blocks, hkv, block_size // 16)
    pages = jnp.asarray([[0, 5, 8], [2, 3, 8], [1, 7, 8]], jnp.int32)  # 8 = missing
    rows = np.asarray(page_rows(pages, 8, page_size, block_size)).reshape(hkv, 3, 2)
    for h in range(hkv):
        for j, p in enumerate(np.asarray(pages[h])):
            if p == 8:
                continue
            units = [p * 2, p * 2 + 1]
            expect = [layer[u // 4, h, u % 4] for u in units]
            assert list(rows[h, j]) == expect


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    tiny_models.build("qwen3", path, seed=MODEL_SEED)
    return path


POLICIES = ("sketch", "quest")


def _sparse(path, budget, policy="quest", dtype="float32", **kw):
    return LLM(path, dtype=dtype, offload=True, block_size=64, num_ring_slots=2, decode_policy=policy,
               decode_budget=budget, page_size=16, dense_layers=1, **kw)


def _decode_logits(llm, ids, steps):
    """Prefill, then `steps` greedy decode steps: the logits of every step (float32 [steps, vocab])."""
    from jax_offload.attention import embed_tokens
    from jax_offload.engine import _last_logits

    hidden, first = llm._prefill(ids, len(ids) + steps)
    out = [np.asarray(_last_logits(llm.model_config, llm.params, hidden, jnp.int32(len(ids) - 1 - first)))]
    try:
        for i in range(steps - 1):
            token = np.full((1, 1), int(out[-1].argmax()), np.int32)
            hidden = llm._runner.decode(embed_tokens(llm.params.embed, token), len(ids) + i)
            out.append(np.asarray(_last_logits(llm.model_config, llm.params, hidden, jnp.int32(0))))
    finally:
        llm._runner.finish()
    return np.stack(out)


@pytest.mark.parametrize("policy", POLICIES)
def test_full_budget_equals_full_decode(model_dir, policy):
    """With a budget covering the whole context, the policy reads every page: the same logits and tokens as
    full decode, across block flushes."""
    ids = np.random.default_rng(502).integers(3, tiny_models.VOCAB, size=150).tolist()
    full = LLM(model_dir, dtype="float32", offload=True, block_size=64, num_ring_slots=2)
    quest = _sparse(model_dir, 1024, policy)
    diff = np.abs(_decode_logits(quest, ids, 60) - _decode_logits(full, ids, 60)).max()
    assert diff <= 1e-5, f"model seed {MODEL_SEED}, prompt seed 502: {diff}"
    assert quest.generate([ids], GREEDY)[0].token_ids == full.generate([ids], GREEDY)[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_mirror_reads_the_same_bits(model_dir, monkeypatch, dtype):
    """A chunked prefill reads a "pages" layer's earlier blocks from the prefill mirror (copies of their own, which
    overlap compute on a GPU) where the copies fit, in GPU memory first, then pinned, from the layer's one buffer
    where they do not: the same logits to the bit every way, only pinned reads counted as PCIe bytes, and the
    mirror gone once the prefill ends."""
    from jax_offload.kv import host_store

    ids = np.random.default_rng(507).integers(3, tiny_models.VOCAB, size=200).tolist()
    runs = {}
    for mirror in ("device", "pinned_host", None):
        where = f"model seed {MODEL_SEED}, prompt seed 507, {dtype}, mirror {mirror}"
        llm = LLM(model_dir, dtype=dtype, offload=True, block_size=64, num_ring_slots=2, decode_policy="sketch",
                  decode_budget=48, page_size=16, dense_layers=1)
        store, sources = llm._runner.store, []
        room = 1 << 40 if mirror == "device" else 0  # the CPU backend reports no free device memory: say some
        monkeypatch.setattr(host_store, "device_free_bytes", lambda tp, room=room: room)
        if mirror is None:  # pinned memory for the store and nothing more
            monkeypatch.setattr(host_store, "pinned_limit_bytes", lambda: store.host_bytes)
        fetch = store.fetch

        def spy(keys, store=store, sources=sources, fetch=fetch):
            if store.places[keys[0][0]] == "pages":
                held = store._mirror is not None and all(key in store._mirror for key in keys)
                sources.append(store._mirror[keys[0]].sharding.memory_kind if held else None)
                if held and sources[-1] == "device":  # written into the buffers allocated when the prefill began
                    assert len(store._mirror) + len(store._mirror_spare) == store.places.count("pages") * 3, keys
            return fetch(keys)

        monkeypatch.setattr(store, "fetch", spy)
        runs[mirror] = _decode_logits(llm, ids, 3)
        assert sources and set(sources) == {mirror}, f"{where}: reads {sources}"
        page_layers = store.places.count("pages")
        assert llm._runner.last_prefill_mirror == ({mirror: page_layers} if mirror else {}), where
        # 4 chunks: chunk c reads c earlier blocks of each layer whose reads cross PCIe (the dense layer's: GPU memory)
        pcie_layers = 0 if mirror == "device" else page_layers
        assert llm._runner.last_prefill_pcie_bytes == 6 * pcie_layers * store.block_bytes, where
        assert store._mirror is None, where
    for mirror in ("device", "pinned_host"):
        np.testing.assert_array_equal(runs[mirror], runs[None],
                                      err_msg=f"model seed {MODEL_SEED}, prompt seed 507, {dtype}: mirror {mirror}")


def test_budget_past_max_model_len_reads_every_page(model_dir, policy="quest"):
    """A budget larger than the whole store (max_model_len 256, budget 1024) reads every page: full decode (the
    runner caps the budget for every page policy alike)."""
    ids = np.random.default_rng(505).integers(3, tiny_models.VOCAB, size=150).tolist()
    full = LLM(model_dir, dtype="float32", offload=True, block_size=64, num_ring_slots=2, max_model_len=256)
    quest = _sparse(model_dir, 1024, policy, max_model_len=256)
    diff = np.abs(_decode_logits(quest, ids, 40) - _decode_logits(full, ids, 40)).max()
    assert diff <= 1e-5, f"model seed {MODEL_SEED}, prompt seed 505: {diff}"


# Quest's page scores have no Pallas kernel: its Pallas path is the sketch's paged kernel reading each KV head's
# chosen rows (`attend_rows`), so "quest" (passed here too until the suite needed the time; last at 07ab582) adds
# nothing the sketch does not run.
@pytest.mark.parametrize("policy", ["sketch"])
def test_pallas_path_equals_jnp_path(model_dir, policy):
    """With a budget below the context (pages skipped), the policy through the Pallas kernels (the sketch's scores,
    and the paged kernel reading each KV head's chosen rows as one K|V pool, on a GPU straight from pinned memory)
    gives the jnp path's logits."""
    ids = np.random.default_rng(504).integers(3, tiny_models.VOCAB, size=200).tolist()
    logits = {impl: _decode_logits(_sparse(model_dir, 64, policy, attention_impl=impl), ids, 20)
              for impl in ("pallas", "xla")}
    diff = np.abs(logits["pallas"] - logits["xla"]).max()
    assert diff <= 1e-5, f"model seed {MODEL_SEED}, prompt seed 504: {diff}"


@pytest.mark.skipif(not on_hopper(), reason="the Hopper sketch kernel runs on sm_90 GPUs only")
def test_bfloat16_sketch_on_the_hopper_kernel_equals_the_triton_kernel(tmp_path_factory, monkeypatch):
    """In bfloat16 with head dim 128 on a Hopper GPU the engine scores the sketch with the Mosaic GPU kernel
    (pallas_kernels/mgpu_sketch.py) over int4 words. With the Triton kernel instead (the one checked against float64
    on the CPU, over int4 bytes) and nothing else changed, decode chooses the same pages: the same logits, bit for
    bit. (Against the jnp path the test would be ill-posed in bfloat16: the two paths' attention rounds differently,
    the next query moves, and a random tiny model's near-tied pages swap: its full decode's greedy tokens part from
    the jnp path's too.)"""
    path = tiny_models.build_in(tmp_path_factory, "qwen3_d128", seed=MODEL_SEED)
    ids = np.random.default_rng(507).integers(3, tiny_models.VOCAB, size=300).tolist()

    def decode():
        jax.clear_caches()  # the routing is decided when the engine's steps are traced
        llm = LLM(path, dtype="bfloat16", offload=True, block_size=64, num_ring_slots=2, attention_impl="pallas",
                  decode_policy="sketch", decode_budget=64, page_size=16, dense_layers=1)
        codes = llm._runner.pages.codes[1]
        routed = runs_on_hopper_kernel(codes, bits=4)
        return routed, _decode_logits(llm, ids, 30)

    on_hopper_kernel, hopper = decode()
    monkeypatch.setattr(mgpu_sketch, "is_supported", lambda q, codes: False)
    on_triton_kernel, triton = decode()
    monkeypatch.undo()
    jax.clear_caches()
    assert on_hopper_kernel and not on_triton_kernel
    diff = np.abs(hopper - triton).max()
    assert diff == 0, f"model seed {MODEL_SEED}, prompt seed 507: logits differ by {diff}"


@pytest.mark.parametrize("policy", POLICIES)
def test_bytes_moved_and_metadata_size(model_dir, policy):
    quest = _sparse(model_dir, 64, policy)
    cfg = quest.model_config
    # Greedy and past EOS: an unseeded sample could end the request at its first token, before any decode step.
    quest.generate([np.random.default_rng(503).integers(3, 250, size=300).tolist()],
                   SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    runner = quest._runner
    sparse_layers = cfg.num_layers - 1
    kv_bytes_per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert runner.last_decode_pcie_bytes == 64 * sparse_layers * kv_bytes_per_token_layer
    described = runner.store.block_bytes * runner.store.num_blocks * sparse_layers
    # Quest: min and max per 16-token page, 1/16 of the KV; the int4 sketch: half a byte per key element and a
    # float32 scale per token and KV head, (D / 2 + 4) / (4 D) of the float32 KV here.
    d = cfg.head_dim
    expected = described / 16 if policy == "quest" else described * (d / 2 + 4) / (2 * d * 4)
    assert runner.pages.nbytes == expected
    assert runner.store.gpu_bytes == runner.store.block_bytes * runner.store.num_blocks  # the dense layer


@pytest.mark.parametrize("policy", POLICIES)
def test_back_to_back_requests_share_nothing(model_dir, policy):
    rng = np.random.default_rng(504)
    long, short = rng.integers(3, 250, size=400).tolist(), rng.integers(3, 250, size=90).tolist()
    shared = _sparse(model_dir, 48, policy)
    first = shared.generate([short], GREEDY)[0].token_ids
    shared.generate([long], GREEDY)
    fresh = _sparse(model_dir, 48, policy).generate([short], GREEDY)[0].token_ids
    assert shared.generate([short], GREEDY)[0].token_ids == first == fresh


@pytest.mark.parametrize("prefill,dtype", [("chunked", "int4"), ("layerwise", "int8")])
def test_sketch_is_written_with_every_stored_block(model_dir, prefill, dtype):
    """After a prefill (chunked or layerwise) and decode steps that flush the tail, every stored key of every
    sparse layer has its sketch: the codes and scales of the keys in the host store, and nothing past them is
    read (a page past the written ones gets no mass)."""
    from jax_offload.kv.host_store import from_stored_layout
    from jax_offload.sparse import sketch

    ids = np.random.default_rng(506).integers(3, tiny_models.VOCAB, size=150).tolist()
    llm = _sparse(model_dir, 32, "sketch", prefill=prefill, sketch_dtype=dtype)
    llm._prefill(ids, 200)
    from jax_offload.attention import embed_tokens
    for i in range(40):  # 150 + 40 tokens: the third block is flushed during decode
        llm._runner.decode(embed_tokens(llm.params.embed, np.full((1, 1), 5, np.int32)), len(ids) + i)
    runner = llm._runner
    written = runner._written[1]
    assert written == 2, written
    for layer in runner.pages.layers:
        buffer = runner.store.layer_buffer(layer)[:written]  # [blocks, Hkv, units, 2, 16, D]
        pages = buffer.transpose(1, 0, 2, 3, 4, 5).reshape(buffer.shape[1], -1, *buffer.shape[3:])
        stored = np.asarray(from_stored_layout(pages))  # [2, T, Hkv, D]
        codes, scale = sketch.quantize_keys(jnp.asarray(stored[0].transpose(1, 0, 2)), dtype)
        pages = written * 64 // 16
        kept_codes = sketch.from_page_layout(runner.pages.codes[layer][:, :, :pages])
        kept_scales = sketch.from_page_layout(runner.pages.scales[layer][:, :, :pages])
        np.testing.assert_array_equal(np.asarray(kept_codes),
                                      np.asarray(sketch.pack_codes(codes, dtype, runner.pages.words)))
        np.testing.assert_array_equal(np.asarray(kept_scales), np.asarray(scale))
    runner.finish()


@pytest.mark.parametrize("kwargs,message", [
    (dict(decode_policy="nope"), "decode_policy 'nope' is unknown; valid: full, sketch, quest"),
    (dict(decode_policy="sketch", sketch_dtype="int2"), "sketch_dtype 'int2' is unknown; valid: int4, int8"),
    (dict(sketch_dtype="int8"), "sketch_dtype applies only with decode_policy='sketch'"),
    (dict(decode_policy="quest", page_size=24), "page_size must be a multiple of 16 that divides block_size"),
    (dict(decode_policy="quest", decode_budget=100), "decode_budget must be a positive multiple of page_size 16"),
    (dict(decode_policy="quest", dense_layers=9), "dense_layers must be an integer from 0 to the model's 2 layers"),
    (dict(decode_budget=256), "decode_budget applies only with decode_policy 'sketch' or 'quest'"),
    (dict(sparse_policy="full", decode_policy="quest"), "sparse_policy is the old name of decode_policy"),
    (dict(decode_policy="quest", sparse_cache_gb=-1.0), "sparse_cache_gb must be a number of GiB >= 0, got -1.0"),
    (dict(decode_policy="sketch", decode_budget=64, dense_layers=1, sparse_cache_gb=2**-20),
     "sparse_cache_gb 9.5367431640625e-07 holds 0 pages per KV head and layer, fewer than the decode budget's 4; "
     "give at least 3.05e-05, or 0 for no cache"),
])
def test_bad_page_policy_options(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, dtype="float32", offload=True, block_size=64, **kwargs)


# The jnp path: in Pallas interpret mode the kernel is XLA ops that fuse differently in the cache's program (1e-6
# apart here); on a GPU it is one kernel call reading the same rows in the same order, and the copy reads the missing
# rows in place from the pinned store: both run there.
@pytest.mark.parametrize("policy,impl,dtype", [("sketch", "xla", "float32"), ("quest", "xla", "float32"),
                                               ("sketch", "xla", "bfloat16")]
                         + [("sketch", "pallas", "bfloat16"), ("quest", "pallas", "float32")]
                         * (jax.default_backend() == "gpu"))
def test_page_cache_changes_no_bit(model_dir, policy, impl, dtype):
    """With a GPU cache of chosen pages (`sparse_cache_gb`) each step reads its pages from the cache once its misses
    are copied in: the logits of every step equal those without the cache to the bit (float32 and bfloat16), and
    later steps hit. A second request starts from an empty cache (its pages are not the first one's) and equals a
    fresh engine's."""
    rng = np.random.default_rng(508)
    ids, other = rng.integers(3, tiny_models.VOCAB, size=400).tolist(), rng.integers(3, 250, size=300).tolist()
    where = f"model seed {MODEL_SEED}, prompt seed 508, {policy}, {impl}, {dtype}"
    gib = 2**-14 if dtype == "float32" else 2**-15  # 8 pages per KV head either way
    plain = _sparse(model_dir, 64, policy, dtype=dtype, attention_impl=impl)
    cached = _sparse(model_dir, 64, policy, dtype=dtype, attention_impl=impl, sparse_cache_gb=gib)
    cache = cached._runner.page_cache
    assert cache.slots == 8, where  # twice the budget of 64 tokens: 4 pages of 16 per KV head
    np.testing.assert_array_equal(_decode_logits(cached, ids, 24), _decode_logits(plain, ids, 24), err_msg=where)
    hits, chosen, _ = cache.totals()
    assert 0 < hits <= chosen, f"{where}: the last step hit {hits} of {chosen} pages"
    fresh = _sparse(model_dir, 64, policy, dtype=dtype, attention_impl=impl, sparse_cache_gb=gib)
    assert cached.generate([other], GREEDY)[0].token_ids == fresh.generate([other], GREEDY)[0].token_ids, where


def test_page_cache_plan_is_lru_per_kv_head():
    """`page_cache.plan` over 40 steps of random choices (3 KV heads, 6 of 20 pages a step, 9 slots) against a Python
    LRU per KV head: the same hits, the same page in every slot, every chosen page's slot holds it once the misses
    are copied in, and the copy lists exactly the misses with their slots."""
    from jax_offload.sparse import page_cache

    seed = 509
    rng = np.random.default_rng(seed)
    hkv, k, num_pages, slots = 3, 6, 20, 9
    state = page_cache.CacheState(jnp.zeros((slots, hkv, 1, 2, 16, 8)), jnp.full((hkv, slots), -1, jnp.int32),
                                  jnp.full((hkv, slots), -1, jnp.int32), jnp.full((hkv, num_pages), -1, jnp.int32))
    ref_page, ref_used = np.full((hkv, slots), -1), np.full((hkv, slots), -1)
    for step in range(40):
        chosen = np.sort(np.stack([rng.choice(num_pages, k, replace=False) for _ in range(hkv)]), axis=-1)
        chosen[0, -1] = num_pages  # a missing entry (past every page)
        use = page_cache.plan(state, jnp.asarray(chosen, jnp.int32), num_pages, jnp.int32(step))
        hits, copies = 0, []
        for h in range(hkv):
            valid = [p for p in chosen[h] if p < num_pages]
            hit = [p for p in valid if p in ref_page[h]]
            hits += len(hit)
            held = {int(np.flatnonzero(ref_page[h] == p)[0]) for p in hit}
            free = sorted((s for s in range(slots) if s not in held), key=lambda s: (ref_used[h, s], s))
            for s in held:
                ref_used[h, s] = step
            for p, s in zip([p for p in valid if p not in hit], free):
                ref_page[h, s], ref_used[h, s] = p, step
                copies.append((h, p, s))
        where = f"seed {seed}, step {step}"
        assert int(use.hits.sum()) == hits, where
        np.testing.assert_array_equal(np.asarray(use.state.page), ref_page, err_msg=where)
        slot, page = np.asarray(use.slots), np.asarray(use.state.page)
        for h in range(hkv):
            for j, p in enumerate(chosen[h]):
                if p < num_pages:
                    assert page[h, slot[h, j]] == p, where
        miss_pages, miss_slots = np.asarray(use.miss_pages), np.asarray(use.miss_slots)
        listed = [(h, p, s) for h in range(hkv) for p, s in zip(miss_pages[h], miss_slots[h]) if s < slots]
        assert listed == copies, where
        assert all(p == num_pages for h in range(hkv) for p, s in zip(miss_pages[h], miss_slots[h]) if s == slots), \
            where
        state = use.state


def _one_request(llm, prompt, params):
    """The tokens of the one-request path (`SerialEngine`): the reference the batch engine is held to (`generate` of
    one prompt takes the batch engine itself offloaded with sketch or Quest on the Pallas kernels)."""
    engine = llm._serial_engine()
    engine.add_request("alone", prompt, params)
    return run_requests(engine, ["alone"], None)[0].token_ids


def _together_and_alone(llm, reference, prompts, params):
    together = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm._batch_engine
    alone = [_one_request(reference, p, sp) for p, sp in zip(prompts, params)]
    return together, alone, engine


XATTN_CHUNKED = dict(prefill_policy="xattention", prefill="chunked", xattn_threshold=0.5, xattn_stride=4,
                     xattn_block=16)


@pytest.mark.parametrize("policy,impl,dtype,options", [
    ("sketch", "pallas", "float32", {}), ("quest", "xla", "float32", dict(max_model_len=512, host_kv_tokens=2048)),
    ("sketch", "xla", "bfloat16", {}), ("sketch", "xla", "float32", XATTN_CHUNKED)])
def test_page_policy_prompts_together_equal_each_alone(model_dir, policy, impl, dtype, options):
    """Offloaded sketch and Quest decode on the batch engine: 4 prompts of 70..450 tokens (budget 64 of them),
    greedy and seeded, together give each one's tokens alone (the one-request path), in float32 and in bfloat16,
    after full or XAttention prefill: each request's pages are chosen from its own metadata, kept by store block,
    and read at its store pages. The store is empty after. With a store of more tokens than max_model_len
    (`host_kv_tokens`), prompts that one request's length could not hold together still run together."""
    rng = np.random.default_rng(510)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in (300, 70, 190, 450)]
    # The greedy 190-token prompt moves into its fourth block (to 210 tokens) while the four decode together.
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)] * 2
    llm = _sparse(model_dir, 64, policy, attention_impl=impl, max_num_seqs=4, dtype=dtype,
                  **{"max_model_len": 2048, **options})
    together, alone, engine = _together_and_alone(llm, llm, prompts, params)
    where = f"model seed {MODEL_SEED}, prompt seed 510, {policy}, {impl}, {dtype}, {options}"
    assert max(n for kind, n, _, _ in engine.step_log if kind == "decode") == 4, where
    assert together == alone, where
    assert llm._runner.store.live_blocks() == [], where
    # One prompt alone takes the batch engine too on the Pallas kernels (its steps run ahead), the one-request path
    # on the XLA twins.
    assert llm._single_prompt_batches() == (impl == "pallas"), where


@pytest.mark.parametrize("impl", ["xla"] + ["pallas"] * (jax.default_backend() == "gpu"))
def test_page_cache_regions_in_a_batch_change_no_bit(model_dir, impl):
    """The batch engine with a page cache of two regions (twice the budget each) and 4 sketch requests of
    70..450 tokens decoding together: the first two to decode read their pages through their own regions, the
    others from the store, and every request gets its tokens alone without the cache (float32, greedy and seeded).
    Later steps hit; the regions are free at the end, and after a one-request run through the whole cache the batch
    gives the same answers again. The one-request path refuses to run among the batch's requests (it shares their
    store: it used to overwrite their blocks)."""
    rng = np.random.default_rng(513)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in (300, 70, 190, 450)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True)] * 2
    where = f"model seed {MODEL_SEED}, prompt seed 513, {impl}"
    plain = _sparse(model_dir, 64, "sketch", attention_impl=impl, max_num_seqs=4, max_model_len=2048)
    alone = [_one_request(plain, p, sp) for p, sp in zip(prompts, params)]
    cached = _sparse(model_dir, 64, "sketch", attention_impl=impl, max_num_seqs=4, max_model_len=2048,
                     sparse_cache_gb=2**-13)
    assert cached._runner.page_cache.slots == 16, where  # two regions of 8 slots: twice the budget's 4 pages
    assert [o.token_ids for o in cached.generate(prompts, params)] == alone, where
    runner = cached._batch_engine.runner
    assert runner.cache_regions_in_use == 0, where
    hits, chosen, _ = runner.cache.totals()
    assert 0 < hits <= chosen, f"{where}: the last step hit {hits} of {chosen} pages"
    assert cached.generate(prompts[:1], params[:1])[0].token_ids == alone[0], where
    if impl == "pallas":  # generate of one prompt took the batch engine: the one-request path through the whole cache
        assert _one_request(cached, prompts[0], params[0]) == alone[0], where
    assert [o.token_ids for o in cached.generate(prompts, params)] == alone, where
    # The one-request path shares the store (and the cache) with the batch: it refuses to run among its requests.
    cached.add_request("r0", prompts[0], params[0])
    cached.step()
    with pytest.raises(RuntimeError, match="generate needs an idle engine"):
        cached.generate(prompts[:1], params[:1])
    cached.abort("r0")
    cached.step()
    assert not cached.has_unfinished() and runner.cache_regions_in_use == 0, where
    # One request at a time (max_num_seqs=1): its region is the whole cache, and the tokens stay alone's.
    single = _sparse(model_dir, 64, "sketch", attention_impl=impl, max_num_seqs=1, max_model_len=2048,
                     sparse_cache_gb=2**-13)
    engine = single._batch()
    assert engine.runner._region_slots == 16, where
    assert engine.generate(prompts[3:], params[3:])[0].token_ids == alone[3], where


@pytest.mark.parametrize("cache", [{}, dict(sparse_cache_gb=2**-13)])
def test_page_policy_prompts_preempted_equal_each_alone(model_dir, cache):
    """Sketch decode on the batch engine over a store of 8 blocks: requests are preempted and recomputed (their
    blocks, and the metadata kept by block, written again; with a page cache, their regions given back and taken
    anew), and every request still gets its tokens alone."""
    rng = np.random.default_rng(511)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in (250, 240, 100, 60)]
    params = [SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=90, ignore_eos=True)] * 2
    llm = _sparse(model_dir, 64, "sketch", max_num_seqs=4, max_model_len=512, **cache)
    together, alone, engine = _together_and_alone(llm, _sparse(model_dir, 64, "sketch", max_model_len=512),
                                                  prompts, params)
    where = f"model seed {MODEL_SEED}, prompt seed 511, {cache}"
    assert engine.stats.recomputes > 0, where
    assert together == alone, where
    if cache:
        assert engine.runner.cache_regions_in_use == 0 and engine.runner.cache.totals()[0] > 0, where


def test_no_state_leak_over_a_thousand_mixed_requests(model_dir):
    """1,000 requests through the incremental API on the batch engine (sketch decode over XAttention-free chunked
    prefill, an 8-block store: preemptions, a page cache of 4 regions), prompts of 1..120 tokens, greedy and seeded, a
    tenth aborted after their first token: at the end no request, store block, pool block, tail slot, cache region or
    sequence's tables is held, and requests that ran beside others still equal themselves alone."""
    rng = np.random.default_rng(512)
    cache = dict(sparse_cache_gb=2**-13)  # 16 pages per KV head: regions for 4 of the 16 running requests
    llm = _sparse(model_dir, 32, "sketch", max_num_seqs=16, max_model_len=512, **cache)
    requests = {}
    for i in range(1000):
        ids = rng.integers(3, 250, size=int(rng.integers(1, 121))).tolist()
        sp = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i, max_tokens=int(rng.integers(1, 7)),
                            ignore_eos=True)
        requests[f"r{i}"] = (ids, sp)
        llm.add_request(f"r{i}", ids, sp)
    outputs, aborted = {}, set()
    while llm.has_unfinished():
        for delta in llm.step():
            rid = delta.request_id
            if int(rid[1:]) % 10 == 9 and rid not in aborted and not delta.finished:
                llm.abort(rid)
                aborted.add(rid)
            elif delta.finished:
                outputs[rid] = delta.output.token_ids
    engine, runner = llm._batch_engine, llm._runner
    where = f"model seed {MODEL_SEED}, prompt seed 512"
    assert engine.stats.recomputes > 0, where
    assert runner.store.live_blocks() == [] and engine.blocks.num_used == 0, where
    assert len(engine.runner._free_slots) == engine.scheduler.max_num_seqs, where
    assert engine.runner.cache_regions_in_use == 0 and engine.runner.sequences_held == 0, where
    reference = _sparse(model_dir, 32, "sketch", max_model_len=512, **cache)
    for rid in ["r0", "r1", "r2", "r500", "r998"]:
        ids, sp = requests[rid]
        assert outputs[rid] == reference.generate([ids], sp)[0].token_ids, f"{where}: {rid}"


def test_page_policy_prompts_after_a_cached_prefix_equal_each_alone(model_dir):
    """Sketch decode with prefix caching: prompts that start with an earlier prompt's 200 tokens prefill after its
    3 cached blocks (their KV and sketch kept in the store) and give the tokens of a fresh engine."""
    rng = np.random.default_rng(513)
    base = rng.integers(3, 250, size=200).tolist()
    prompts = [base + rng.integers(3, 250, size=int(n)).tolist() for n in (10, 90, 150)]
    cached = _sparse(model_dir, 64, "sketch", enable_prefix_caching=True, max_model_len=1024)
    cached.generate([base], GREEDY)
    outputs = cached.generate(prompts, GREEDY)
    fresh = _sparse(model_dir, 64, "sketch", max_model_len=1024)
    where = f"model seed {MODEL_SEED}, prompt seed 513"
    assert [o.num_cached_tokens for o in outputs] == [192] * 3, where
    assert [o.token_ids for o in outputs] == [fresh.generate([p], GREEDY)[0].token_ids for p in prompts], where
