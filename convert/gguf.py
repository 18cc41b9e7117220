"""Dequantize a Llama GGUF checkpoint into a plain Hugging Face directory (float32 safetensors).

NumPy only: gguf-py dequantizes the blocks and `tokenizers` rebuilds the tokenizer, so a run needs
no PyTorch. The output equals what transformers' GGUF loader (torch) produces; tests/test_gguf_convert.py
checks that tensor by tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import TokenizersBackend

GGUF_MAGIC = b"GGUF"

# GGUF metadata key -> LlamaConfig field, as transformers' GGUF loader maps them.
_CONFIG_KEYS = {
    "general.name": "_model_name_or_path",
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.feed_forward_length": "intermediate_size",
    "llama.embedding_length": "hidden_size",
    "llama.rope.dimension_count": "head_dim",
    "llama.rope.freq_base": "rope_theta",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "llama.vocab_size": "vocab_size",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# GGUF tensor name (blk.N. prefix stripped) -> Hugging Face LlamaForCausalLM parameter name.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# transformers' GGUF loader splits these byte-level vocabularies with the plain GPT-2 pattern of
# `ByteLevel(use_regex=True)`; a pre-tokenizer with its own pattern would need that pattern here too.
_BYTE_LEVEL_PRE_TOKENIZERS = ("default", "gpt-2", "smollm")
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens such as <|im_end|>


def _check_gguf(gguf_path: Path) -> None:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist.")
    with gguf_path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{gguf_path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r}).")


def _mirror_rope_theta(config_path: Path) -> None:
    # transformers 5 writes rope_theta only inside rope_parameters; transformers 4.x and plain
    # JSON readers look for it at the top level and would silently fall back to 10000.
    config = json.loads(config_path.read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
    if prefix == "blk" and layer.isdigit() and rest in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a Hugging Face Llama model.")


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's q/k rows for its rotary kernel; Hugging Face Llama
    # rotates the two halves of a head. This is transformers' reverse_permute, step for step.
    half_dim = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half_dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def _state_dict(reader: GGUFReader, n_heads: int, n_kv_heads: int) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    state = {}
    for tensor in reader.tensors:
        # F16/F32 tensors come back in their own dtype and quantized blocks as float32; the cast
        # makes every weight float32, as transformers' loader does.
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.endswith(".attn_q.weight"):
            weight = _unpermute_rope_rows(weight, n_heads)
        elif tensor.name.endswith(".attn_k.weight"):
            weight = _unpermute_rope_rows(weight, n_kv_heads)
        state[_hf_tensor_name(tensor.name)] = weight
    return state


def _tokenizer(meta: dict[str, Any]) -> TokenizersBackend:
    """The tokenizer transformers builds from this GGUF's metadata, made with `tokenizers` alone."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import TokenizersBackend

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported; only byte-level BPE ('gpt2') is.")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(_BYTE_LEVEL_PRE_TOKENIZERS)}.")
    tokens = meta["tokenizer.ggml.tokens"]
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    for token in tokens:
        if not set(token) <= alphabet:
            raise ValueError(f"GGUF token {token!r} is not spelled in the byte-level alphabet.")

    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    # No prefix space: llama.cpp applies add_space_prefix to SentencePiece vocabularies only.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Control tokens must stay whole in the text instead of being split into byte pieces.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == _CONTROL_TOKEN])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    return TokenizersBackend(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=meta.get("tokenizer.ggml.add_bos_token", False),
        add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files to out_dir.

    Returns out_dir. The GGUF must hold a Llama model with a byte-level BPE tokenizer.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    _check_gguf(gguf_path)

    # Heavy imports stay local so importing this module is cheap.
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from transformers import GenerationConfig, LlamaConfig

    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; only 'llama' is.")

    fields = {name: meta[key] for key, name in _CONFIG_KEYS.items() if key in meta}
    # A GGUF without an output matrix reuses the embedding for the LM head.
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    fields.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"

    state = _state_dict(reader, config.num_attention_heads, config.num_key_value_heads)
    tokenizer = _tokenizer(meta)

    out_dir.mkdir(parents=True, exist_ok=True)
    # "pt" is the format tag transformers expects on a safetensors checkpoint it loads.
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    _mirror_rope_theta(out_dir / "config.json")
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
