"""Bad input gets one clear error, and the engine stays usable."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import tiny_models
from jax_offload import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
MODEL_SEED = 4321  # the tiny model's weights; these tests check errors, not numbers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    tiny_models.build("llama_tied", out, seed=MODEL_SEED)
    return out, LLM(out, dtype="float32", max_model_len=128)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _still_usable(llm):
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 4


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")


def test_corrupt_and_truncated_safetensors(model, tmp_path):
    path, llm = model
    corrupt = _copy(path, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="Cannot read safetensors file"):
        LLM(corrupt, dtype="float32")
    truncated = _copy(path, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="Cannot read safetensors file"):
        LLM(truncated, dtype="float32")
    _still_usable(llm)


def test_missing_extra_and_misshaped_tensors(model, tmp_path):
    path, _ = model
    tensors = load_file(path / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
                    "lacks tensor model.layers.1.mlp.up_proj.weight"),
        "extra": (tensors | {"model.layers.0.mystery.weight": np.ones(3, np.float32)},
                  "unexpected tensor model.layers.0.mystery.weight"),
        "misshaped": (tensors | {"model.norm.weight": np.ones(7, np.float32)},
                      r"Tensor model.norm.weight in model.safetensors has shape \(7,\), expected \(64,\)"),
    }
    for name, (content, message) in cases.items():
        bad = _copy(path, tmp_path / name)
        save_file(content, bad / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            LLM(bad, dtype="float32")


def test_pickled_weights_are_refused(model, tmp_path):
    path, _ = model
    bad = _copy(path, tmp_path / "bin")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickled .bin weights"):
        LLM(bad, dtype="float32")


def test_unsupported_architecture_and_rope(model, tmp_path):
    path, _ = model
    for name, change, message in [
        ("arch", {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "supported: LlamaForCausalLM"),
        ("rope", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "Unsupported rope type 'yarn'"),
    ]:
        bad = _copy(path, tmp_path / name)
        cfg = json.loads((bad / "config.json").read_text()) | change
        cfg.pop("rope_parameters", None) if name == "rope" else None
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=message):
            LLM(bad, dtype="float32")


def test_bad_prompts(model):
    _, llm = model
    with pytest.raises(ValueError, match="The prompt is empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="The prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="The prompt has 200 tokens; max_model_len 128"):
        llm.generate([[5] * 200], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 10**6]], GREEDY)
    _still_usable(llm)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
        (dict(top_k=0), "top_k must be -1"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(max_tokens=-5), "max_tokens must be an integer >= 1"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(stop=[""]), "stop must be a non-empty string"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generation_stops_at_max_model_len(model):
    _, llm = model
    out = llm.generate([[5] * 120], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 128 - 120
    assert out.finish_reason == "length"


def test_sampling_is_reproducible_by_seed(model):
    _, llm = model
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    a, b = llm.generate([[5, 6, 7], [5, 6, 7]], params)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-tokens", "x"], "argument --max-tokens: invalid int value"),
        (["--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number"),
        (["--prompt", "   "], "the prompt is empty"),
        (["--prompt", "hi", "--model", "/no/such/dir"], "does not exist"),
    ],
)
def test_cli_bad_arguments_one_line(argv, message):
    run = subprocess.run([sys.executable, "-m", "jax_offload.generate", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert "Traceback" not in run.stderr


def test_cli_defaults_are_the_engines():
    """Every engine option of the CLI (and so the server) defaults to `LLM`'s and `EngineConfig`'s value: batch
    invariance on unless `--no-batch-invariant`."""
    import dataclasses
    import inspect

    from jax_offload import generate
    from jax_offload.config import EngineConfig

    llm_defaults = {k: p.default for k, p in inspect.signature(LLM.__init__).parameters.items()}
    config_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    args = generate.build_parser().parse_args(["--prompt", "x"])
    for name in generate._LLM_OPTIONS:
        assert getattr(args, name) == llm_defaults[name], name
        if name in config_defaults and config_defaults[name] is not None:
            assert llm_defaults[name] == config_defaults[name], name
    assert args.batch_invariant is True
    assert generate.build_parser().parse_args(["--prompt", "x", "--no-batch-invariant"]).batch_invariant is False
