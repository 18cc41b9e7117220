"""The offloaded engine reorders work only: it must give what the in-GPU engine gives."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import tiny_models
from jax_offload import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


MODEL_SEEDS = {"llama3": 201, "qwen3": 202}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> (checkpoint, in-GPU float32 LLM, seed for messages), each built once for the file."""
    built = {}
    for variant, seed in MODEL_SEEDS.items():
        out = tmp_path_factory.mktemp(variant)
        tiny_models.build(variant, out, seed=seed)
        built[variant] = out, LLM(out, dtype="float32"), f"model seed {seed}"
    return built


@pytest.fixture(params=list(MODEL_SEEDS))
def model(request, models):
    return models[request.param]


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, tiny_models.VOCAB, size=n).tolist()


# Each point on one model (every point on both until the suite needed the time; last passed at 0cf451f): the
# offloaded path's blocks, ring and prefill modes run the model code the in-GPU engine runs, and each model still
# meets every block size and both prefill modes (Llama every pair of them).
@pytest.mark.parametrize(
    "variant,block_size,num_ring_slots,num_tokens,prefill",
    [
        ("llama3", 16, 1, 5, "chunked"),
        ("qwen3", 16, 2, 16, "layerwise"),
        ("qwen3", 16, 4, 320, "chunked"),
        ("llama3", 16, 8, 171, "layerwise"),
        ("qwen3", 16, 1, 200, "layerwise"),
        ("llama3", 64, 2, 1280, "layerwise"),
        ("qwen3", 64, 8, 700, "chunked"),
        ("llama3", 64, 1, 64, "chunked"),
        ("qwen3", 256, 4, 5120, "chunked"),
        ("llama3", 256, 2, 3000, "layerwise"),
        ("llama3", 256, 8, 300, "chunked"),
    ],
)
def test_offload_logits_equal_in_gpu(models, variant, prefill, block_size, num_ring_slots, num_tokens):
    path, in_gpu, seed = models[variant]
    ids = _ids(np.random.default_rng(num_tokens), num_tokens)
    offload = LLM(path, dtype="float32", offload=True, block_size=block_size, num_ring_slots=num_ring_slots, prefill=prefill)
    assert np.abs(offload.logits(ids) - in_gpu.logits(ids)).max() <= 1e-5, f"{seed}, prompt seed {num_tokens}"


# Each prefill mode on one model (both on both until the suite needed the time; last passed at 0cf451f).
@pytest.mark.parametrize("variant,prefill", [("llama3", "chunked"), ("qwen3", "layerwise")])
def test_long_greedy_decode_crosses_blocks(models, variant, prefill):
    path, in_gpu, seed = models[variant]
    ids = _ids(np.random.default_rng(7), 100)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    offload = LLM(path, dtype="float32", offload=True, block_size=64, num_ring_slots=2, prefill=prefill)
    # 100 + 300 tokens: the decode flushes its tail to the host at 128, 192, 256, 320 and 384.
    assert offload.generate([ids], params)[0].token_ids == in_gpu.generate([ids], params)[0].token_ids, seed


# The state tests below on one model each (both on both until the suite needed the time; last passed at 0cf451f):
# what they check (the store's blocks and buffers, the ring, the tail) is the same whatever the model.
def test_back_to_back_requests_leak_no_state(models):
    path, _, seed = models["qwen3"]
    rng = np.random.default_rng(11)
    # 20 prompts until the suite needed the time (the host tier's tests; last passed at a1ffcf2), 10 until 2026-11-26.
    prompts = [_ids(rng, int(n)) for n in rng.integers(1, 200, size=6)]
    # max_num_seqs: the prompts' number (a chunk step carries a decode row per sequence the engine may run).
    kwargs = dict(dtype="float32", offload=True, block_size=16, num_ring_slots=2, max_num_seqs=len(prompts))
    shared = LLM(path, **kwargs)
    one_by_one = [shared.generate([p], GREEDY)[0].token_ids for p in prompts]
    in_one_call = [o.token_ids for o in shared.generate(prompts, GREEDY)]
    fresh = [LLM(path, **kwargs).generate([p], GREEDY)[0].token_ids for p in prompts]
    assert one_by_one == fresh, f"{seed}, prompt seed 11"
    assert in_one_call == one_by_one, f"{seed}, prompt seed 11"
    # A short request after a long one must not see the long one's blocks or tail.
    long_then_short = [shared.generate([p], GREEDY)[0].token_ids for p in (prompts[0], _ids(rng, 300), prompts[0])]
    assert long_then_short[0] == long_then_short[2] == one_by_one[0], f"{seed}, prompt seed 11"


@contextlib.contextmanager
def _compiles():
    """The programs XLA compiles inside the block, one entry each."""
    import jax

    compiles = []

    def count(event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


@pytest.mark.parametrize("policy", [{}, dict(prefill_policy="xattention", xattn_stride=4, xattn_block=16)],
                         ids=["full", "xattention"])
def test_an_engine_from_params_compiles_nothing_new_for_a_longer_prompt(models, policy):
    """A prompt chunk's programs compile once, whatever its groups of earlier blocks: parameters handed to
    `LLM.from_params` (here from NumPy, uncommitted, as random or converted weights come) join the mesh the
    store's blocks live on, so every group sees one placement, and every group is padded to the full group
    size, so it has one shape. After a prompt whose chunks met one group of one block, a longer one compiles
    nothing. (Before the first: a chunk's second group compiled again, ~13 s on the first 128K prompt of the 8B
    shape, `bench/results/runs/h200_sketch_prefill/`; before the second: once per group length, 14 programs of
    ~2 s each, `bench/results/runs/h100_first_prompt_compiles/`.)"""
    import jax
    import jax.numpy as jnp

    path, _, where = models["llama3"]
    loaded = LLM(path, dtype="bfloat16", offload=True)
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), loaded.params)
    llm = LLM.from_params(loaded.model_config, params, dtype="bfloat16", offload=True, block_size=32,
                          num_ring_slots=6, prefill="chunked", **policy)
    rng = np.random.default_rng(208)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([_ids(rng, 32 + 5)], one)  # the second chunk reads one group: (1)
    with _compiles() as compiles:
        llm.generate([_ids(rng, 7 * 32 + 5)], one)  # groups (2), (3), (3, 1), (3, 2), (3, 3), (3, 3, 1)
    assert not compiles, f"{where}, prompt seed 208: {len(compiles)} programs compiled for the longer prompt"


@pytest.mark.parametrize("policy", [{}, dict(decode_policy="sketch", decode_budget=64, page_size=16, dense_layers=1)],
                         ids=["full", "sketch"])
def test_a_second_decode_step_compiles_nothing(models, policy):
    """The first decode step starts from tails and buffers the engine made, later ones from what a step returned:
    both must sit on the mesh alike, or every decode layer compiles twice (~1.6-2 s each for the 8B shape)."""
    path, _, where = models["qwen3"]
    llm = LLM(path, dtype="bfloat16", offload=True, block_size=48, num_ring_slots=2, **policy)
    ids = _ids(np.random.default_rng(209), 96)  # whole blocks: decode starts from an empty tail the engine made
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # one decode step
    with _compiles() as compiles:
        llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # and a second
    assert not compiles, f"{where}, prompt seed 209: {len(compiles)} programs compiled for a second decode step"


def test_a_long_generation_compiles_few_decode_group_shapes(models):
    """A decode step pads each group of stored blocks to a power of two: after a generation whose groups held 1 to 5
    blocks (padded to 1, 2, 4 and 8), a longer one through groups of 6, 7 and 8 blocks compiles nothing. (Unpadded,
    each group length compiled its own program: 3 more here, up to 7 in a long generation with the default ring, ~1 s
    each for the 8B shape on an H100, `bench/results/runs/h100_decode_padding/`.)"""
    path, _, where = models["llama3"]
    llm = LLM(path, dtype="bfloat16", offload=True, block_size=16, num_ring_slots=16)
    ids = _ids(np.random.default_rng(210), 19)
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4 * 16, ignore_eos=True))  # up to 5 blocks stored
    with _compiles() as compiles:
        llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=7 * 16, ignore_eos=True))  # up to 8
    assert not compiles, f"{where}, prompt seed 210: {len(compiles)} programs compiled for groups of 6 to 8 blocks"


def test_host_store_is_written_in_place(models):
    """Blocks are written into the buffers allocated with the store: across 10 requests of random lengths every
    block keeps its address, and pinned host memory stays what it was after the first request (50 requests until
    the suite needed the time, last passed at a1ffcf2; 25 until 2026-11-26)."""
    path, _, seed = models["llama3"]
    llm = LLM(path, dtype="float32", offload=True, block_size=16, num_ring_slots=2, max_model_len=512)
    store = llm._runner.store
    addresses = store.buffer_addresses()
    rng = np.random.default_rng(3)
    llm.generate([_ids(rng, 100)], GREEDY)
    pinned_after_first = _pinned_host_bytes()
    assert store.host_bytes_held() == store.total_bytes
    for n in rng.integers(1, 400, size=10):
        llm.generate([_ids(rng, int(n))], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert store.buffer_addresses() == addresses, seed
    # Every live array in pinned host memory, not just the store's own accounting.
    assert abs(_pinned_host_bytes() - pinned_after_first) <= 0.01 * pinned_after_first


def _pinned_host_bytes() -> int:
    import jax

    return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "pinned_host")


@pytest.mark.parametrize("option,name", [
    (dict(block_size=64), "block_size"), (dict(num_ring_slots=2), "num_ring_slots"),
    (dict(prefill="layerwise"), "prefill"), (dict(sparse_policy="full"), "decode_policy"),
    (dict(decode_policy="quest", decode_budget=512), "decode_policy, decode_budget"),
    (dict(host_kv_tokens=4096), "host_kv_tokens"),
])
def test_offload_options_need_offload(model, option, name):
    path, _, _ = model
    with pytest.raises(ValueError, match=f"{name} appl(y|ies) only to an offloaded KV cache"):
        LLM(path, dtype="float32", **option)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(sparse_policy="nope"), "decode_policy 'nope' is unknown; valid: full, sketch, quest"),
        (dict(prefill="sideways"), "prefill mode 'sideways' is unknown"),
        (dict(block_size=0), "block_size must be a positive multiple of 16"),
        (dict(block_size=100), "block_size must be a positive multiple of 16"),
        (dict(num_ring_slots=0), "num_ring_slots must be an integer >= 1"),
        (dict(max_model_len=512, host_kv_tokens=256),
         "host_kv_tokens must be an integer >= max_model_len 512 .one request's most., got 256"),
        (dict(max_model_len=4096, block_size=16), None),
    ],
)
def test_bad_engine_options(model, kwargs, message, monkeypatch):
    path, in_gpu, _ = model
    if message is None:
        # A store larger than the host's free memory is refused before anything is allocated.
        monkeypatch.setattr("jax_offload.kv.host_store.available_host_bytes", lambda: 1024)
        message = "GiB of host memory is available"
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", offload=True, **kwargs)
    ids = _ids(np.random.default_rng(5), 20)
    assert len(in_gpu.generate([ids], GREEDY)[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("argv, host_gib, expected_gib", [
    # Llama-3.1-8B's shape, 512K tokens of fp8 KV: 1.03 GiB a layer, the store 33.0 GiB. Set: the need + 4 GiB.
    (["--decode-policy", "full"], 128, None),  # the store fits the default 64 GiB
    (["--decode-policy", "sketch"], 128, 69),  # + the 30 page layers' mirror (30.9) + 2 GiB headroom = 65.9
    (["--decode-policy", "quest", "--dense-layers", "0"], 128, 72),  # 32 page layers: 33 + 33 + 2
    (["--decode-policy", "sketch", "--prefill-policy", "xattention"], 128, None),  # layerwise: no mirror
    (["--decode-policy", "sketch"], 48, None),  # no room for the mirror on this host: the store's need only
    # 1M tokens: store 66.0 + mirror 61.9 + 2 is past 7/8 of 128 GiB, so the store's need only (a limit past the
    # host let XLA's pool pin more than an H200 host had: killed).
    (["--decode-policy", "sketch", "--max-model-len", str(1 << 20)], 128, 70),
])
def test_cli_sizes_the_pinned_limit_for_the_prefill_mirror(tmp_path, monkeypatch, argv, host_gib, expected_gib):
    import json
    import os

    from jax_offload import generate
    from jax_offload.kv import host_store

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072}))
    monkeypatch.delenv(host_store.PINNED_LIMIT_VAR, raising=False)
    monkeypatch.setattr(host_store, "total_host_bytes", lambda: host_gib * 2**30)
    args = generate.build_parser().parse_args(
        ["--offload", "--kv-cache-dtype", "fp8", "--max-model-len", str(1 << 19), "--prompt", "x", *argv])
    generate._make_room_for_pinned_kv(tmp_path, args)
    got = os.environ.get(host_store.PINNED_LIMIT_VAR)
    assert got == (None if expected_gib is None else str(expected_gib)), (argv, host_gib, got)
