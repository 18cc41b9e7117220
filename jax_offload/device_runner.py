"""Runs the model layer by layer with the whole KV cache of the request in GPU memory."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.attention import decode_layer_in_device, embed_tokens, prefill_layer_in_device
from jax_offload.buckets import cache_bucket, prompt_bucket
from jax_offload.config import ModelConfig
from jax_offload.models.params import ModelParams
from jax_offload.progress import LaggedProgress
from jax_offload.sparse.xattention import XAttention
from jax_offload.tensor_parallel import TensorParallel


class DeviceRunner:
    """KV cache in GPU memory, sized per request to a length bucket (so shapes, and compiles, repeat), split by KV
    heads over the tensor-parallel devices."""

    def __init__(self, cfg: ModelConfig, params: ModelParams, inv_freq: jax.Array, dtype: jnp.dtype, impl: str,
                 tp: TensorParallel, xattn: XAttention | None = None):
        self.cfg, self.params, self.inv_freq, self.dtype = cfg, params, inv_freq, dtype
        self.impl, self.xattn, self.tp = impl, xattn, tp
        self._k: list[jax.Array] = []
        self._v: list[jax.Array] = []
        self.prefill_block_counts: list[jax.Array] = []  # per layer, XAttention's [selected, visible] blocks

    def prefill(
        self,
        ids: np.ndarray,
        prompt_len: int,
        total_len: int,
        progress: Callable[[float], None] | None = None,
        keep_all: bool = True,
    ) -> tuple[jax.Array, int]:
        """ids [1, T] padded prompt -> (final hidden states [1, T, hidden], 0: position of the first row). The KV
        cache is sized for `total_len` tokens; every row is kept whatever `keep_all` says (the argument is the
        offloaded runner's, which the engine calls the same way)."""
        cfg = self.cfg
        x = embed_tokens(self.params.embed, ids)
        cache_len = max(cache_bucket(total_len), x.shape[1])
        shape = (1, cache_len, cfg.num_kv_heads, cfg.head_dim)
        self._k = [self.tp.zeros(shape, self.dtype, 2) for _ in range(cfg.num_layers)]
        self._v = [self.tp.zeros(shape, self.dtype, 2) for _ in range(cfg.num_layers)]
        length = np.int32(prompt_len)
        done = LaggedProgress(progress)
        self.prefill_block_counts = []
        for i, layer in enumerate(self.params.layers):
            x, self._k[i], self._v[i], counts = prefill_layer_in_device(
                cfg, self.impl, layer, x, self.inv_freq, self._k[i], self._v[i], length, xattn=self.xattn, tp=self.tp
            )
            self.prefill_block_counts.append(counts)
            done.step(x, prompt_len / cfg.num_layers)
        done.close()
        return x, 0

    def decode(self, x: jax.Array, position: int) -> jax.Array:
        """x [1, 1, hidden] embedded new token at `position` -> its final hidden state."""
        pos = np.int32(position)
        for i, layer in enumerate(self.params.layers):
            x, self._k[i], self._v[i] = decode_layer_in_device(
                self.cfg, self.impl, layer, x, self.inv_freq, self._k[i], self._v[i], pos, tp=self.tp
            )
        return x

    def take_cache(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """The request's K and V caches per layer [1, cache_len, Hkv, D], handed over: the runner keeps none."""
        k, v = self._k, self._v
        self._k, self._v = [], []
        return k, v

    def finish(self) -> None:
        """Drops the request's KV cache."""
        self._k, self._v = [], []

    @staticmethod
    def padded_length(prompt_len: int) -> int:
        return prompt_bucket(prompt_len)


def pad_ids(ids: list[int], length: int) -> np.ndarray:
    out = np.zeros((1, length), np.int32)
    out[0, : len(ids)] = ids
    return out
