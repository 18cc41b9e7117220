"""The host KV store: per layer, KV blocks of `block_size` tokens in pinned host memory, allocated once."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding


def available_host_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostKVStore:
    """`num_layers x num_blocks` blocks, each one array [2 (K|V), block_size, num_kv_heads, head_dim].

    Every block is allocated when the store is made and only ever replaced by a block of the same size,
    so the pinned pool reaches its size once and is reused by every request. Which blocks hold data of
    the current request is tracked explicitly and cleared by `reset`, so no request can read another's KV.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        device: jax.Device,
    ):
        self.block_shape = (2, block_size, num_kv_heads, head_dim)
        self.block_bytes = 2 * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        self.total_bytes = num_layers * num_blocks * self.block_bytes
        available = available_host_bytes()
        if self.total_bytes > available:
            raise ValueError(
                f"The host KV store needs {self.total_bytes / 2**30:.2f} GiB for {num_blocks} blocks x {num_layers} "
                f"layers but only {available / 2**30:.2f} GiB of host memory is available; lower max_model_len."
            )
        self.host = SingleDeviceSharding(device, memory_kind="pinned_host")
        self.device = SingleDeviceSharding(device, memory_kind="device")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        zeros = jax.device_put(jnp.zeros(self.block_shape, dtype), self.host)
        self._blocks = [[jax.device_put(zeros, self.host, may_alias=False) for _ in range(num_blocks)] for _ in range(num_layers)]
        self._written = [0] * num_layers

    def write(self, layer: int, index: int, block: jax.Array) -> None:
        """Stores a device block [2, block_size, Hkv, D]; the copy is asynchronous. Blocks are written in order."""
        if index != self._written[layer]:
            raise RuntimeError(f"Block {index} of layer {layer} written out of order (next is {self._written[layer]}).")
        if index >= self.num_blocks:
            raise RuntimeError(f"Block {index} is beyond the store's {self.num_blocks} blocks.")
        self._blocks[layer][index] = jax.device_put(block, self.host)
        self._written[layer] += 1

    def num_written(self, layer: int) -> int:
        return self._written[layer]

    def read(self, layer: int, index: int) -> jax.Array:
        """The host array of a block this request has written (reading any other block is a bug)."""
        if index >= self._written[layer]:
            raise RuntimeError(f"Block {index} of layer {layer} has not been written by this request.")
        return self._blocks[layer][index]

    def reset(self) -> None:
        """Forgets the request: every block counts as unwritten again."""
        self._written = [0] * self.num_layers

    def host_bytes_held(self) -> int:
        return sum(b.nbytes for layer in self._blocks for b in layer)
