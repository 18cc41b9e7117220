"""Tiny random Hugging Face models, saved as real safetensors checkpoints with a word-level tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 256
WORDS = [f"w{i}" for i in range(VOCAB - 3)]

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    initializer_range=0.1,
)

VARIANTS = {
    "llama3": lambda: LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    "qwen2_kv4": lambda: Qwen2Config(
        **{**COMMON, "num_attention_heads": 8, "num_key_value_heads": 4}, rope_theta=1000000.0, tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False),
    # Head dim 128: the shape the Hopper kernels take (tests that run only on such a GPU).
    "qwen3_d128": lambda: Qwen3Config(**COMMON, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3_tied": lambda: Qwen3Config(
        **{**COMMON, "num_attention_heads": 8}, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True
    ),
}


def save_tokenizer(out_dir: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out_dir)


def build_in(tmp_path_factory, variant: str, seed: int) -> Path:
    """A fresh temporary directory holding the `variant` model built with `seed` (for module fixtures)."""
    path = tmp_path_factory.mktemp(variant)
    build(variant, path, seed=seed)
    return path


def build(variant: str, out_dir: Path, seed: int, max_shard_size: str | None = None) -> torch.nn.Module:
    """Builds and saves the model; returns the float32 PyTorch model in eval mode."""
    torch.manual_seed(seed)
    cfg = VARIANTS[variant]()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Norm weights start at exactly 1 and biases at 0; randomise them so every parameter is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    save_tokenizer(out_dir)
    return model
