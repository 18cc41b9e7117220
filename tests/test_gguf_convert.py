"""convert/gguf.py (NumPy, no PyTorch) against transformers' GGUF loader (PyTorch) on the default model's GGUF."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from convert.gguf import _mirror_rope_theta
from jax_offload.default_model import _download_gguf

# With torch hidden every import of it fails, so a finished conversion proves the run path needs none.
CONVERT_WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; from convert.gguf import gguf_to_safetensors; "
    "gguf_to_safetensors(sys.argv[1], sys.argv[2])"
)
# from_pretrained records where a tokenizer was loaded from; that is not part of the tokenizer.
LOAD_PROVENANCE_KEYS = ("is_local", "local_files_only")
TEXTS = [
    "What is the capital of France?",
    "  two leading spaces, digits 1234567 and unicode: café, 東京, 🤖\n\ttab",
    "<|im_start|>user\nHi<|im_end|><|endoftext|>",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _transformers_reference(gguf_path: Path, out_dir: Path):
    """The previous converter (transformers' GGUF loader on PyTorch); writes every file but the weights.

    Two of gguf-py's pure functions are memoized while it loads, which changes no value: transformers builds the
    same tensor-name map once per submodule (397 times, 11 s of its 30 on the 2-core machine) and reads the file's
    fields twice (once for the config, once for the weights: 9 s)."""
    src, name = str(gguf_path.parent), gguf_path.name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.dtype = torch.float32
    model.config.save_pretrained(out_dir)
    _mirror_rope_theta(out_dir / "config.json")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    work = tmp_path_factory.mktemp("gguf_convert")
    gguf_path = _download_gguf(work, quiet=True)
    ours = work / "ours"
    # The two conversions share nothing, so ours runs beside the slower reference.
    convert = subprocess.Popen([sys.executable, "-c", CONVERT_WITHOUT_TORCH, str(gguf_path), str(ours)], stderr=subprocess.PIPE, text=True)
    model, tokenizer = _transformers_reference(gguf_path, work / "reference")
    _, stderr = convert.communicate()
    assert convert.returncode == 0, stderr
    return ours, work / "reference", model, tokenizer


def test_weights_equal_transformers_exactly(converted) -> None:
    ours_dir, _, model, _ = converted
    reference = {k: v.numpy() for k, v in model.state_dict().items()}
    reference.pop("lm_head.weight")  # tied to the embedding, so neither converter stores it
    ours = load_file(str(ours_dir / "model.safetensors"))
    assert sorted(ours) == sorted(reference)
    for name, weight in reference.items():
        assert ours[name].dtype == np.float32 and weight.dtype == np.float32, name
        assert ours[name].shape == weight.shape, name
        assert np.array_equal(ours[name], weight), name


def test_config_and_tokenizer_files_equal_transformers(converted) -> None:
    ours, reference, _, _ = converted
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert json.loads((ours / name).read_text()) == json.loads((reference / name).read_text()), name
    assert (ours / "chat_template.jinja").read_text() == (reference / "chat_template.jinja").read_text()
    ours_config, reference_config = (json.loads((d / "tokenizer_config.json").read_text()) for d in (ours, reference))
    for key in LOAD_PROVENANCE_KEYS:
        reference_config.pop(key, None)
    assert ours_config == reference_config


def test_tokenizer_behaves_like_transformers(converted) -> None:
    ours_dir, _, _, reference = converted
    ours = AutoTokenizer.from_pretrained(ours_dir)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids) == reference.decode(ids), text
    chat = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    assert ours.apply_chat_template(MESSAGES, **chat) == reference.apply_chat_template(MESSAGES, **chat)


def test_logits_equal_transformers(converted) -> None:
    ours_dir, _, reference, tokenizer = converted
    model = AutoModelForCausalLM.from_pretrained(ours_dir, dtype=torch.float32, use_safetensors=True).eval()
    ids = torch.tensor([tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)])
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() <= 1e-5
