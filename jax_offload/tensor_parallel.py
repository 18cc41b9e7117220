"""Tensor parallelism over a 1-D device mesh: each device holds whole KV-head groups (its query heads with
their K and V heads), the matching slice of the MLP, and its share of the KV cache.

Parameters and KV arrays carry `NamedSharding`s over the mesh; the jit-compiled steps let XLA insert the
collectives (the all-reduce after the row-parallel `wo` and `w_down`). Attention runs per device under
`shard_map` over the head axis (`TensorParallel.per_head`), so the Pallas kernels see only local heads.
With one device every helper here is the identity and the steps trace exactly as without a mesh.

Several processes (`jax.distributed.initialize`, one device each) run the same code: the mesh spans every
process's devices and each process drives its own.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_offload.config import ModelConfig

AXIS = "tp"


def check_devices(size: int) -> None:
    """Whether JAX sees devices for a mesh of `size` (the model-side check is `ModelConfig.tensor_parallel_sizes`)."""
    if size > jax.device_count():
        raise ValueError(f"tensor_parallel_size {size} exceeds the {jax.device_count()} devices JAX sees.")
    if jax.process_count() > 1 and size != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size {size} must equal the {jax.device_count()} devices of the "
            f"{jax.process_count()} processes: every process drives its devices in the mesh."
        )


def sharded_model_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model as the devices hold it: with fewer KV heads than devices, each KV head is repeated so that every
    device has one (same attention, as each query head still reads its own KV head's values)."""
    if cfg.num_kv_heads >= size:
        return cfg
    return dataclasses.replace(cfg, num_kv_heads=size)


def _spec(axis: int | None) -> PartitionSpec:
    return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), AXIS)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The device mesh and how arrays are laid out on it; hashable, so jit takes it as a static argument."""

    mesh: Mesh

    @classmethod
    def create(cls, size: int) -> "TensorParallel":
        return cls(Mesh(np.array(jax.devices()[:size]), (AXIS,)))

    @property
    def size(self) -> int:
        return self.mesh.size

    def sharding(self, head_axis: int | None = None, memory_kind: str | None = None) -> NamedSharding:
        """Split on `head_axis` (None: replicated), in `memory_kind` ("device", "pinned_host"; None: default)."""
        return NamedSharding(self.mesh, _spec(head_axis), memory_kind=memory_kind)

    def zeros(self, shape: tuple[int, ...], dtype: jnp.dtype, head_axis: int | None) -> jax.Array:
        """Zeros split on `head_axis`, each device making only its own part; on the mesh with one device too, so a
        step sees the same placement in a buffer it starts from as in the one it returned (else it compiles twice)."""
        if self.size == 1:  # made in place and relabelled: no program of its own per shape to compile
            return jax.device_put(jnp.zeros(shape, dtype), self.sharding(head_axis))
        return _zeros_maker(tuple(shape), jnp.dtype(dtype), self.sharding(head_axis))()

    def replicate(self, tree: Any) -> Any:
        """`tree`'s arrays (NumPy or JAX) copied to every device in one batched transfer, for the inputs of a step
        compiled over the mesh: given as they are (host arrays, or arrays on one device), each would be copied to
        the devices on the host's slow path at every call. The identity on one device."""
        if self.size == 1:
            return tree
        return jax.device_put(tree, self.sharding(None))

    def constrain(self, tree: Any, head_axis: int | Any | None) -> Any:
        """Inside jit: pins `tree` (or each leaf, with a matching pytree of axes) to be split on its head axis."""
        if self.size == 1:
            return tree
        shardings = jax.tree.map(lambda a: self.sharding(a), head_axis, is_leaf=lambda a: a is None)
        return jax.lax.with_sharding_constraint(tree, shardings)

    def per_head(self, fn: Callable, in_axes: tuple, out_axes: Any) -> Callable:
        """`fn` run on each device with only its heads: `in_axes` gives per positional argument (a pytree prefix)
        the head axis or None for replicated; `out_axes` the same for the outputs."""
        if self.size == 1:
            return fn
        specs = functools.partial(jax.tree.map, _spec, is_leaf=lambda a: a is None)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(tuple(in_axes)), out_specs=specs(out_axes),
                             check_vma=False)


@functools.lru_cache(maxsize=None)
def _zeros_maker(shape, dtype, sharding) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def host_memory_kind() -> str:
    """Where host copies of device arrays live: pinned memory where the device has it (it crosses PCIe fastest)."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else "unpinned_host"


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated (or single-device) array as NumPy, also when other processes hold copies of it."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))
