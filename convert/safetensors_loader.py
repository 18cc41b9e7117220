"""Hugging Face safetensors (one file or sharded) -> `ModelParams` in the requested dtype.

Only safetensors are read: pickled `.bin` checkpoints can run arbitrary code when loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from safetensors import SafetensorError, safe_open

from jax_offload.config import ModelConfig
from jax_offload.models.params import LayerParams, ModelParams

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not match the model config."""


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Maps every tensor name of the checkpoint in `model_dir` to the file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index ({err}).") from None
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {name: single for name in _tensor_names(single)}
    if any(model_dir.glob("*.bin")):
        raise CheckpointError(f"{model_dir} holds only pickled .bin weights; convert them to safetensors first.")
    raise CheckpointError(f"No {SINGLE_FILE} or {INDEX_FILE} in {model_dir}.")


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="flax") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"Cannot read safetensors file {path}: {err}.") from None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor the model needs (HF layout: [out, in])."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if cfg.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def load_params(model_dir: str | Path, cfg: ModelConfig, dtype: jnp.dtype) -> ModelParams:
    """Reads, checks and converts the checkpoint in `model_dir` into `ModelParams` of `dtype`."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    want = expected_shapes(cfg)
    # A tied checkpoint may still carry a copy of the embedding as lm_head; it is redundant.
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(want) - set(files))
    if missing:
        raise CheckpointError(f"Checkpoint in {model_dir} lacks tensor {missing[0]} ({len(missing)} missing).")
    extra = sorted(set(files) - set(want) - ignorable - _rotary_buffers(files))
    if extra:
        raise CheckpointError(f"Checkpoint in {model_dir} has unexpected tensor {extra[0]} ({len(extra)} extra).")

    tensors: dict[str, jax.Array] = {}
    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="flax") as f:
                for name in names:
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != want[name]:
                        raise CheckpointError(f"Tensor {name} in {path.name} has shape {shape}, expected {want[name]}.")
                    tensors[name] = f.get_tensor(name).astype(dtype)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"Cannot read safetensors file {path}: {err}.") from None
    return _assemble(cfg, tensors)


def _rotary_buffers(files: dict[str, Path]) -> set[str]:
    # Old exports saved RoPE's inv_freq buffer; it is recomputed from the config.
    return {n for n in files if n.endswith("rotary_emb.inv_freq")}


def _assemble(cfg: ModelConfig, t: dict[str, jax.Array]) -> ModelParams:
    # Tensors are popped as they are fused so that peak memory stays near one copy of the model.
    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        wqkv = jnp.concatenate([t.pop(a + "q_proj.weight"), t.pop(a + "k_proj.weight"), t.pop(a + "v_proj.weight")]).T
        bqkv = (
            jnp.concatenate([t.pop(a + "q_proj.bias"), t.pop(a + "k_proj.bias"), t.pop(a + "v_proj.bias")])
            if cfg.qkv_bias
            else None
        )
        layers.append(
            LayerParams(
                attn_norm=t.pop(p + "input_layernorm.weight"),
                wqkv=wqkv,
                bqkv=bqkv,
                q_norm=t.pop(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=t.pop(a + "k_norm.weight") if cfg.qk_norm else None,
                wo=t.pop(a + "o_proj.weight").T,
                mlp_norm=t.pop(p + "post_attention_layernorm.weight"),
                w_gate_up=jnp.concatenate([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")]).T,
                w_down=t.pop(p + "mlp.down_proj.weight").T,
            )
        )
    return ModelParams(
        embed=t["model.embed_tokens.weight"],
        layers=layers,
        final_norm=t["model.norm.weight"],
        lm_head=None if cfg.tie_word_embeddings else t["lm_head.weight"].T,
    )
