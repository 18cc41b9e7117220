"""The host KV store: per layer, KV blocks of `block_size` tokens in pinned host memory, allocated once and
written in place.

A block is stored head-major in pages of PAGE_UNIT tokens, [Hkv, block_size / PAGE_UNIT, 2 (K|V), PAGE_UNIT, D],
so that one KV head's page (its keys and values together) is one contiguous run of bytes: a sparse decode
policy can gather the pages each head selected without touching the others. Whole blocks cross PCIe in this
layout and are rearranged on the GPU (`from_stored_layout`), where it costs a pass over HBM, not PCIe.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

PAGE_UNIT = 16  # tokens per stored page: the finest page a sparse policy can select; block sizes are multiples


def available_host_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def to_stored_layout(kv: jax.Array) -> jax.Array:
    """[2, T, Hkv, D] (K|V) -> [Hkv, T / PAGE_UNIT, 2, PAGE_UNIT, D]."""
    _, t, hkv, d = kv.shape
    return kv.reshape(2, t // PAGE_UNIT, PAGE_UNIT, hkv, d).transpose(3, 1, 0, 2, 4)


def from_stored_layout(pages: jax.Array) -> jax.Array:
    """[Hkv, n, 2, PAGE_UNIT, D] -> [2, n * PAGE_UNIT, Hkv, D] (K|V)."""
    hkv, n, _, unit, d = pages.shape
    return pages.transpose(2, 1, 3, 0, 4).reshape(2, n * unit, hkv, d)


class HostKVStore:
    """`num_layers x num_blocks` blocks in pinned host memory, each [Hkv, block_size / PAGE_UNIT, 2, PAGE_UNIT, D].

    Every block is allocated when the store is made; `write` copies a GPU block into the existing buffer (a
    donated in-place update), so the pinned pool reaches its size once and every request reuses the same
    buffers. Which blocks hold data of the current request is tracked explicitly and cleared by `reset`, so
    no request can read another's KV.
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
        memory_kind: str = "pinned_host",
    ):
        """`memory_kind="device"` keeps the blocks on the GPU instead (benchmarks use it to time compute
        without transfers)."""
        self.block_shape = (num_kv_heads, block_size // PAGE_UNIT, 2, PAGE_UNIT, head_dim)
        self.block_bytes = 2 * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        self.total_bytes = num_layers * num_blocks * self.block_bytes
        available = available_host_bytes()
        if self.total_bytes > available:
            raise ValueError(
                f"The host KV store needs {self.total_bytes / 2**30:.2f} GiB for {num_blocks} blocks x {num_layers} "
                f"layers but only {available / 2**30:.2f} GiB of host memory is available; lower max_model_len."
            )
        self.host = SingleDeviceSharding(device, memory_kind=memory_kind)
        self.device = SingleDeviceSharding(device, memory_kind="device")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        zeros = jax.device_put(jnp.zeros(self.block_shape, dtype), self.host)
        self._blocks = [[jax.device_put(zeros, self.host, may_alias=False) for _ in range(num_blocks)] for _ in range(num_layers)]
        self._written = [0] * num_layers
        host = self.host

        def write_in_place(old: jax.Array, kv: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_slice(old, jax.device_put(to_stored_layout(kv), host), (0,) * old.ndim)

        self._write_in_place = jax.jit(write_in_place, donate_argnums=0)

    def write(self, layer: int, index: int, kv: jax.Array) -> None:
        """Stores a GPU block kv [2, block_size, Hkv, D] into its buffer; the copy is asynchronous. Blocks are
        written in order."""
        if index != self._written[layer]:
            raise RuntimeError(f"Block {index} of layer {layer} written out of order (next is {self._written[layer]}).")
        if index >= self.num_blocks:
            raise RuntimeError(f"Block {index} is beyond the store's {self.num_blocks} blocks.")
        self._blocks[layer][index] = self._write_in_place(self._blocks[layer][index], kv)
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

    def buffer_addresses(self) -> list[list[int]]:
        """Where each block's pinned buffer lives: unchanged for the store's lifetime."""
        return [[b.unsafe_buffer_pointer() for b in layer] for layer in self._blocks]
