"""Hugging Face safetensors (one file or sharded) -> `ModelParams` in the requested dtype, on a tensor-parallel mesh.

Only safetensors are read: pickled `.bin` checkpoints can run arbitrary code when loaded.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jax_offload.config import ModelConfig
from jax_offload.models.params import LayerParams, ModelParams
from jax_offload.models.sharded_layout import attention_output_rows, mlp_rows, qkv_rows
from jax_offload.tensor_parallel import TensorParallel, sharded_model_config

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


def load_params(model_dir: str | Path, cfg: ModelConfig, dtype: jnp.dtype, tp: TensorParallel) -> ModelParams:
    """Reads, checks and converts the checkpoint in `model_dir` into `ModelParams` of `dtype`, laid out over
    `tp`'s devices: each device's shard of a split tensor is read from the files on its own (only the rows
    it holds), replicated tensors once per process."""
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
    with _Reader(files, want, jnp.dtype(dtype)) as reader:
        return _assemble(cfg, reader, tp)


def _rotary_buffers(files: dict[str, Path]) -> set[str]:
    # Old exports saved RoPE's inv_freq buffer; it is recomputed from the config.
    return {n for n in files if n.endswith("rotary_emb.inv_freq")}


class _Reader:
    """Rows of checkpoint tensors as NumPy arrays in the target dtype, read with safetensors' slices (only the
    requested rows leave the file). The slices are made on the host CPU device, never on an accelerator."""

    def __init__(self, files: dict[str, Path], shapes: dict[str, tuple[int, ...]], dtype: jnp.dtype):
        self._files, self._shapes, self._dtype = files, shapes, dtype
        self._open: dict[Path, object] = {}
        self._checked: set[str] = set()
        try:
            self._host = jax.local_devices(backend="cpu")[0]
        except RuntimeError:  # no CPU backend (JAX_PLATFORMS excludes it): the default device then
            self._host = None

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def _file(self, path: Path):
        if path not in self._open:
            try:
                self._open[path] = safe_open(path, framework="flax").__enter__()
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"Cannot read safetensors file {path}: {err}.") from None
        return self._open[path]

    def rows(self, name: str, start: int | None = None, stop: int | None = None, columns: bool = False) -> np.ndarray:
        """Tensor `name` (HF layout), or its rows [start, stop) (its columns with `columns`), in the dtype."""
        path = self._files[name]
        try:
            piece = self._file(path).get_slice(name)
            if name not in self._checked:
                shape = tuple(piece.get_shape())
                if shape != self._shapes[name]:
                    raise CheckpointError(f"Tensor {name} in {path.name} has shape {shape}, expected {self._shapes[name]}.")
                self._checked.add(name)
            with jax.default_device(self._host):
                part = piece[:, start:stop] if columns else piece[start:stop]
            return np.asarray(part).astype(self._dtype, copy=False)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"Cannot read safetensors file {path}: {err}.") from None


def _place(tp: TensorParallel, shape: tuple[int, ...], split_axis: int | None,
           read: Callable[[int], np.ndarray]) -> jax.Array:
    """A global array split on `split_axis` (None: replicated) whose shard g is `read(g)`; only the shards of
    this process's devices are read, and a replicated tensor once."""
    sharding = tp.sharding(split_axis)
    width = 1 if split_axis is None else shape[split_axis] // tp.size
    cache: dict[int, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        g = 0 if split_axis is None else (index[split_axis].start or 0) // width
        if g not in cache:
            cache[g] = read(g)
        return cache[g]

    return jax.make_array_from_callback(shape, sharding, shard)


def _assemble(cfg: ModelConfig, r: _Reader, tp: TensorParallel) -> ModelParams:
    """Parameters in the fused layout of `sharded_layout`, one tensor at a time so that host memory holds at
    most one tensor's shards."""
    n = tp.size
    held = sharded_model_config(cfg, n)  # the KV heads as the devices hold them
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_width = (held.num_heads + 2 * held.num_kv_heads) * d

    def qkv(a: str, suffix: str, g: int) -> np.ndarray:
        parts = [r.rows(a + proj + suffix, *rows) for proj, rows in zip(("q_proj.", "k_proj.", "v_proj."),
                                                                        qkv_rows(cfg, n, g))]
        return np.concatenate(parts).T if suffix == "weight" else np.concatenate(parts)

    def gate_up(p: str, g: int) -> np.ndarray:
        rows = mlp_rows(cfg, n, g)
        return np.concatenate([r.rows(p + "mlp.gate_proj.weight", *rows), r.rows(p + "mlp.up_proj.weight", *rows)]).T

    def whole(name: str, transpose: bool = False) -> jax.Array:
        shape = r.shape(name)
        if transpose:
            return _place(tp, shape[::-1], None, lambda g: r.rows(name).T)
        return _place(tp, shape, None, lambda g: r.rows(name))

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerParams(
            attn_norm=whole(p + "input_layernorm.weight"),
            wqkv=_place(tp, (h, qkv_width), 1, lambda g: qkv(a, "weight", g)),
            bqkv=_place(tp, (qkv_width,), 0, lambda g: qkv(a, "bias", g)) if cfg.qkv_bias else None,
            q_norm=whole(a + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=whole(a + "k_norm.weight") if cfg.qk_norm else None,
            wo=_place(tp, (cfg.num_heads * d, h), 0,
                      lambda g: r.rows(a + "o_proj.weight", *attention_output_rows(cfg, n, g), columns=True).T),
            mlp_norm=whole(p + "post_attention_layernorm.weight"),
            w_gate_up=_place(tp, (h, 2 * cfg.intermediate_size), 1, lambda g: gate_up(p, g)),
            w_down=_place(tp, (cfg.intermediate_size, h), 0,
                          lambda g: r.rows(p + "mlp.down_proj.weight", *mlp_rows(cfg, n, g), columns=True).T),
            num_shards=n,
        ))
    return ModelParams(
        embed=whole("model.embed_tokens.weight"),
        layers=layers,
        final_norm=whole("model.norm.weight"),
        lm_head=None if cfg.tie_word_embeddings else whole("lm_head.weight", transpose=True),
    )
