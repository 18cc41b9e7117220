"""The offloaded KV store: per layer, KV blocks of `block_size` tokens, allocated once and written in place. One
request uses blocks 0, 1, ... of every layer; several requests at once (continuous batching) each own the blocks
of their block table, the same ids in every layer.

A block is kept head-major in pages of PAGE_UNIT tokens, [Hkv, block_size / PAGE_UNIT, 2 (K|V), PAGE_UNIT, D], so
one KV head's page (its keys and values together) is one contiguous run of bytes. Whole blocks cross PCIe in
this layout and are rearranged on the GPU (`from_stored_layout`), where it costs a pass over HBM, not PCIe.

Each layer lives in one of three places:
  - "gpu": one GPU buffer for all the layer's blocks (the dense layers of a sparse decode policy; nothing
    crosses PCIe, and a decode step's kernel reads the stored layout straight from the buffer);
  - "blocks": one pinned-host buffer per block, moved to the GPU group by group (full attention);
  - "pages": one pinned-host buffer for all the layer's blocks, from which the Pallas paged kernel reads the
    pages a sparse policy selects, from any block, over PCIe (zero copy); the jnp path gathers them in one pass
    on the host and moves them as one transfer (`gather_rows`).

A chunked prefill reads each chunk's earlier blocks back. XLA runs a program that slices a pinned buffer in order
with the compute programs (`bench/results/runs/h200_sketch_prefill/`: a slice program and a matmul cost their sum on
an H100; in one program too, and a second stream is refused), while a `device_put` of whole pinned arrays overlaps
compute. So during a chunked prefill the blocks written to "pages" layers are also kept as buffers of their own (the
prefill mirror, `start_mirror`), read the way "blocks" layers are, and dropped when the prefill ends: in GPU memory
where it has room (a 1M-token prompt's mirror does not fit beside its store in a 125 GiB host, and an H200 has room for
it), else pinned.

Under tensor parallelism every buffer is split on its KV-head axis over the mesh: each device's heads live in
pinned memory attached to that device and cross only its own link.

With kv_cache_dtype "fp8" or "int8" a one-buffer layer is a `QuantizedKV` pair of buffers, 8-bit values and their
scales [..., 1] in the same layout, which the Pallas kernels read in place; every operation here maps over both
(`jax.tree.map`). A "blocks" layer's block is one buffer, the pair packed per row as bytes [..., D + 4]
(`kv_cache_dtype.pack`), so it crosses PCIe as one copy; the reader unpacks it on the GPU as it dequantizes.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_offload.kv import kv_cache_dtype as kv_format
from jax_offload.tensor_parallel import TensorParallel

PAGE_UNIT = 16  # tokens per stored page: the finest page a sparse policy can select; block sizes are multiples
PLACES = ("gpu", "blocks", "pages")


# XLA's pinned host allocator on a GPU stops at this many GiB unless the variable raises it (read once, when the
# GPU backend starts).
PINNED_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_PINNED_LIMIT_GB = 64
MIRROR_HEADROOM_BYTES = 2 * 2**30  # pinned memory left free beside the store and a prefill mirror
# GPU memory a prefill mirror leaves free for the chunked prefill's own buffers (at 1M tokens of the 8B shape: a layer's
# keys, 2 GiB, XAttention's estimate scores, 1 GiB, a 16K-token chunk's activations) and the other requests' steps.
DEVICE_MIRROR_HEADROOM_BYTES = 16 * 2**30


def available_host_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_host_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pinned_bytes(num_layers: int, tokens: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, dtype,
                 mirror_layers: int | None = None) -> int:
    """Pinned host bytes an offloaded store of `tokens` tokens in each of `num_layers` layers takes; with
    `mirror_layers`, plus a chunked prefill's mirror of that many page layers and its headroom (`start_mirror`)."""
    layer = 2 * tokens * num_kv_heads * kv_format.bytes_per_vector(kv_cache_dtype, head_dim, dtype)
    mirror = 0 if mirror_layers is None else mirror_layers * layer + MIRROR_HEADROOM_BYTES
    return num_layers * layer + mirror


def device_free_bytes(tp: TensorParallel) -> int:
    """GPU memory XLA can still allocate on the fullest device of the mesh; 0 where the backend does not say (CPU) or
    the mesh spans processes (each would see its own devices and could place a mirror where the others do not)."""
    if len(tp.mesh.local_devices) < tp.mesh.size:
        return 0
    stats = [device.memory_stats() for device in tp.mesh.local_devices]
    if any(not s or "bytes_limit" not in s for s in stats):
        return 0
    return min(s["bytes_limit"] - s["bytes_in_use"] for s in stats)


def pinned_limit_gb(store_bytes: int, with_mirror_bytes: int | None = None) -> int:
    """The value of PINNED_LIMIT_VAR for a store of `store_bytes` (`pinned_bytes`) and, where they fit in the host's
    memory less an eighth kept for the process, a prefill mirror and its headroom (`with_mirror_bytes`: store and
    mirror, `pinned_bytes(mirror_layers=...)`); 4 GiB more for swap space and small buffers. Never more than that:
    XLA's pool grows in doubling regions up to its limit and, where the host has less, backs off until one fits, so
    a limit past what the host can spare pins it all (an H200 host of 125 GiB was killed at a 1M-token store of 66
    GiB under a limit of 134)."""
    fits = with_mirror_bytes is not None and with_mirror_bytes <= total_host_bytes() * 7 // 8
    return int((with_mirror_bytes if fits else store_bytes) / 2**30) + 4


def pinned_limit_bytes() -> int | None:
    """How much pinned host memory XLA will allocate on this backend; None where it sets no limit (CPU)."""
    if jax.default_backend() != "gpu":
        return None
    return int(float(os.environ.get(PINNED_LIMIT_VAR, DEFAULT_PINNED_LIMIT_GB)) * 2**30)


def to_stored_layout(kv: jax.Array | kv_format.QuantizedKV) -> jax.Array | kv_format.QuantizedKV:
    """[2, T, Hkv, D] (K|V) -> [Hkv, T / PAGE_UNIT, 2, PAGE_UNIT, D], each leaf of a stored KV array."""
    def one(kv):
        _, t, hkv, d = kv.shape
        return kv.reshape(2, t // PAGE_UNIT, PAGE_UNIT, hkv, d).transpose(3, 1, 0, 2, 4)

    return jax.tree.map(one, kv)


def from_stored_layout(pages: jax.Array | kv_format.QuantizedKV) -> jax.Array | kv_format.QuantizedKV:
    """[Hkv, n, 2, PAGE_UNIT, D] -> [2, n * PAGE_UNIT, Hkv, D] (K|V), each leaf of a stored KV array."""
    def one(pages):
        hkv, n, _, unit, d = pages.shape
        return pages.transpose(2, 1, 3, 0, 4).reshape(2, n * unit, hkv, d)

    return jax.tree.map(one, pages)


@functools.partial(jax.jit, static_argnums=(1, 2))
def stored_block(kv: jax.Array, kv_cache_dtype: str, dtype: jnp.dtype) -> jax.Array:
    """A GPU block [2, T, Hkv, D] as a "blocks" layer (or the prefill mirror) stores it: encoded, in the stored
    layout, packed; still on the GPU."""
    return kv_format.pack(to_stored_layout(kv_format.encode(kv_cache_dtype, kv, dtype)))


def _host_compute(fn):
    """`fn` run on the host CPU next to the pinned buffers it reads (compute_on moved in jax 0.11)."""
    from jax.experimental import compute_on

    try:
        return compute_on.compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    except TypeError:  # jax 0.10: a context manager
        def on_host(*args):
            with compute_on.compute_on("device_host"):
                return fn(*args)

        return on_host


class HostKVStore:
    """`num_layers x num_blocks` blocks of [Hkv, block_size / PAGE_UNIT, 2, PAGE_UNIT, D], placed per layer.

    Every buffer is allocated when the store is made and `write` copies a GPU block into it in place (a donated
    update), so the pinned pool reaches its size once and every request reuses the same buffers. Which blocks
    hold live data is tracked explicitly, set by `write` and cleared by `reset` (every block) or `forget` (a
    finished request's), and reading any other block is an error, so no request can read another's stale KV.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        tp: TensorParallel,
        places: Sequence[str] | None = None,
        host_memory_kind: str = "pinned_host",
        kv_cache_dtype: str = "auto",
    ):
        """`places[l]` is "gpu", "blocks" (default) or "pages" (see the module docstring).
        `host_memory_kind="device"` keeps even the host layers on the GPU (benchmarks use it to time compute
        without transfers). `dtype` is the model's; `kv_cache_dtype` how blocks store it."""
        places = list(places or ["blocks"] * num_layers)
        if len(places) != num_layers or not set(places) <= set(PLACES):
            raise ValueError(f"places {places} must name one of {PLACES} for each of the {num_layers} layers.")
        self.block_shape = (num_kv_heads, block_size // PAGE_UNIT, 2, PAGE_UNIT, head_dim)
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.block_bytes = 2 * block_size * num_kv_heads * kv_format.bytes_per_vector(kv_cache_dtype, head_dim, dtype)
        self.places = places
        layer_bytes = num_blocks * self.block_bytes
        self.gpu_bytes = places.count("gpu") * layer_bytes
        self.host_bytes = (num_layers - places.count("gpu")) * layer_bytes
        self.total_bytes = self.host_bytes + self.gpu_bytes
        available = available_host_bytes()
        if self.host_bytes > available:
            raise ValueError(
                f"The host KV store needs {self.host_bytes / 2**30:.2f} GiB for {num_blocks} blocks x "
                f"{num_layers - places.count('gpu')} layers but only {available / 2**30:.2f} GiB of host memory is "
                "available; lower max_model_len" + (" or use kv_cache_dtype='int8'." if kv_cache_dtype == "auto"
                                                    else ".")
            )
        limit = pinned_limit_bytes() if host_memory_kind == "pinned_host" else None
        if limit is not None and self.host_bytes > limit:
            wanted = -(-self.host_bytes // 2**30) + 4  # headroom for the swap space and small buffers
            raise ValueError(
                f"The host KV store needs {self.host_bytes / 2**30:.2f} GiB of pinned memory but XLA's pinned pool "
                f"stops at {limit / 2**30:.0f} GiB; set {PINNED_LIMIT_VAR}={wanted} before the process starts JAX "
                f"(the CLI does it from --max-model-len), or lower max_model_len."
            )
        self.tp, self.host_memory_kind = tp, host_memory_kind
        self.device = tp.sharding(0, memory_kind="device")  # a fetched block: [Hkv, ...] on the GPUs
        self._block_sharding = tp.sharding(0, host_memory_kind)  # a "blocks" layer's block, or a mirrored one
        self._mirror: dict[tuple[int, int], jax.Array] | None = None  # the prefill mirror's blocks
        self._mirror_sharding: dict[int, jax.sharding.Sharding] = {}  # where each mirrored layer's blocks live
        self._mirror_spare: list[jax.Array] = []  # GPU mirror buffers not yet written
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # A one-buffer layer ("gpu", "pages") is [num_blocks, Hkv, ...]: split on axis 1; a block on axis 0.
        self._sharding = [tp.sharding(0 if p == "blocks" else 1, "device" if p == "gpu" else host_memory_kind)
                          for p in places]
        zeros = kv_format.pack(self._empty(self.block_shape, 0))
        self._blocks: list = []  # per layer: a list of blocks, or one buffer (each a stored KV array)
        for place, sharding in zip(places, self._sharding):
            if place == "blocks":
                self._blocks.append([jax.device_put(zeros, sharding, may_alias=False) for _ in range(num_blocks)])
                continue
            # A host layer's zeros are made on the GPU and copied out one layer at a time: queued together, every
            # layer's GPU zeros could be alive at once (bench/results/runs/h100_memory_peak/).
            layer = jax.device_put(self._empty((num_blocks, *self.block_shape), 1), sharding)
            self._blocks.append(jax.block_until_ready(layer))
        self._written = np.zeros((num_layers, num_blocks), bool)
        # Bytes moved between host and GPU since the store was made (the server's metrics), pages of sparse decode
        # aside.
        self.bytes_read = self.bytes_written = 0

    def _empty(self, shape: tuple[int, ...], head_axis: int):
        """A zero stored KV array of `shape` on the mesh, split on `head_axis`."""
        return kv_format.empty(self.kv_cache_dtype, shape, self.dtype,
                               lambda shape, dtype: self.tp.zeros(shape, dtype, head_axis))

    @staticmethod
    @functools.partial(jax.jit, static_argnums=(2, 3, 4), donate_argnums=(0,))
    def _write_block(old, kv: jax.Array, sharding, kv_cache_dtype: str, dtype):
        new = stored_block(kv, kv_cache_dtype, dtype)
        return jax.lax.dynamic_update_slice(old, jax.device_put(new, sharding), (0,) * old.ndim)

    @staticmethod
    @functools.partial(jax.jit, donate_argnums=(0,))
    def _fill(spare, block: jax.Array) -> jax.Array:
        """`block` written into a spare buffer of the GPU mirror (donated: the copy lands in its memory)."""
        return jax.lax.dynamic_update_slice(spare, block, (0,) * spare.ndim)

    @staticmethod
    @functools.partial(jax.jit, static_argnums=(3, 4, 5, 6), donate_argnums=(0,))
    def _write_into_layer(layer, kv: jax.Array, index: jax.Array, sharding, kv_cache_dtype: str, dtype,
                          mirrored: bool = False):
        """(the layer with block `index` written, and with `mirrored` the block as the prefill mirror keeps it, still
        on the GPU: `stored_block` of the same encoding, made once for both; else None)."""
        new = to_stored_layout(kv_format.encode(kv_cache_dtype, kv, dtype))
        # [1, Hkv, ...]: the layer's head axis
        layer = jax.tree.map(lambda layer, new: jax.lax.dynamic_update_slice(
            layer, jax.device_put(new[None], sharding), (index,) + (0,) * (layer.ndim - 1)), layer, new)
        return layer, kv_format.pack(new) if mirrored else None

    def start_mirror(self, num_blocks: int) -> dict[str, int]:
        """Keeps a copy of each block written to a "pages" layer from now on as a buffer of its own, so that a chunked
        prefill's reads of up to `num_blocks` blocks per layer overlap compute (module docstring): a layer's copies in
        GPU memory where they fit beside DEVICE_MIRROR_HEADROOM_BYTES (read without crossing PCIe), else in pinned
        memory where they fit beside the store, else none (read from the layer's one buffer). Returns how many page
        layers each memory kind mirrors."""
        layer_need = num_blocks * self.block_bytes
        self.stop_mirror()
        if self.host_memory_kind == "device" or not layer_need:
            return {}
        device_room = device_free_bytes(self.tp) - DEVICE_MIRROR_HEADROOM_BYTES
        limit = pinned_limit_bytes() if self.host_memory_kind == "pinned_host" else None
        host_room = min(available_host_bytes(), limit - self.host_bytes - MIRROR_HEADROOM_BYTES if limit else 1 << 62)
        for layer, place in enumerate(self.places):
            if place != "pages":
                continue
            if layer_need // self.tp.size <= device_room:  # each device holds its heads' share
                device_room -= layer_need // self.tp.size
                self._mirror_sharding[layer] = self.tp.sharding(0, "device")
            elif layer_need <= host_room:
                host_room -= layer_need
                self._mirror_sharding[layer] = self._block_sharding
        if self._mirror_sharding:
            self._mirror = {}
        # A GPU mirror's buffers are allocated now, side by side: made block by block as the prefill writes them, in
        # the holes its large short-lived buffers leave, they fragmented XLA's pool until a 2.5 GiB buffer found no
        # room (a 1M-token prompt on an H200, bench/results/runs/h200_1m_prefill/).
        device_layers = [l for l, s in self._mirror_sharding.items() if s.memory_kind == "device"]
        if device_layers:
            zeros = kv_format.pack(self._empty(self.block_shape, 0))
            self._mirror_spare = [jax.device_put(zeros, self._mirror_sharding[l], may_alias=False)
                                  for l in device_layers for _ in range(num_blocks)]
        kinds = [sharding.memory_kind for sharding in self._mirror_sharding.values()]
        return {kind: kinds.count(kind) for kind in sorted(set(kinds))}

    def stop_mirror(self) -> None:
        """Drops the prefill mirror (its buffers return to XLA's pools)."""
        self._mirror, self._mirror_sharding, self._mirror_spare = None, {}, []

    def write(self, layer: int, index: int, kv: jax.Array) -> None:
        """Stores a GPU block kv [2, block_size, Hkv, D] (as the layer computed it: `round_trip` values) as block
        `index` of `layer`, encoded as the store keeps it; the copy is asynchronous."""
        if not 0 <= index < self.num_blocks:
            raise RuntimeError(f"Block {index} is outside the store's {self.num_blocks} blocks.")
        how = (self._sharding[layer], self.kv_cache_dtype, jnp.dtype(self.dtype))
        if self.places[layer] != "blocks":
            mirrored = layer in self._mirror_sharding
            self._blocks[layer], block = self._write_into_layer(self._blocks[layer], kv, np.int32(index), *how,
                                                                mirrored)
            if mirrored:
                sharding = self._mirror_sharding[layer]
                if sharding.memory_kind == "device" and self._mirror_spare:
                    self._mirror[layer, index] = self._fill(self._mirror_spare.pop(), block)
                else:
                    self._mirror[layer, index] = jax.device_put(block, sharding)
        else:
            self._blocks[layer][index] = self._write_block(self._blocks[layer][index], kv, *how)
        self._written[layer, index] = True
        self._count(layer, 1, "bytes_written")

    def reads_cross_pcie(self, layer: int) -> bool:
        """Whether reading a block of `layer` now moves it over PCIe (not a "gpu" layer, nor one the prefill mirror
        keeps in GPU memory)."""
        mirror = self._mirror_sharding.get(layer)
        return self.places[layer] != "gpu" and (mirror is None or mirror.memory_kind != "device")

    def _count(self, layer: int, num_blocks: int, counter: str) -> None:
        """Adds what `num_blocks` blocks of `layer` carry over PCIe to a byte counter (a "gpu" layer's carry
        nothing)."""
        if self.places[layer] != "gpu":
            setattr(self, counter, getattr(self, counter) + num_blocks * self.block_bytes)

    def fetch(self, keys: Sequence[tuple[int, int]]) -> list[jax.Array]:
        """Starts moving the blocks `keys` [(layer, index), ...] to the GPU (asynchronously); blocks of a "gpu"
        or "pages" layer must be of one layer, and each run of consecutive ones is read as one slice (XAttention's
        chunked prefill fetches the blocks it chose, with gaps), unless the prefill mirror holds them all. Reading a
        block that holds no live data is a bug."""
        for layer, index in keys:
            if not self._written[layer, index]:
                raise RuntimeError(f"Block {index} of layer {layer} holds no live KV (never written, or forgotten).")
        layer = keys[0][0]
        if self.places[layer] == "blocks":
            self._count(layer, len(keys), "bytes_read")
            return jax.device_put([self._blocks[l][i] for l, i in keys], self.device)
        if self._mirror is not None and all(key in self._mirror for key in keys):
            if self.reads_cross_pcie(layer):
                self._count(layer, len(keys), "bytes_read")
            return jax.device_put([self._mirror[key] for key in keys], self.device)
        self._count(layer, len(keys), "bytes_read")
        if any(l != layer for l, _ in keys):
            raise RuntimeError(f"Blocks {keys} of a one-buffer layer must be blocks of one layer.")
        runs = [[keys[0][1]]]
        for _, index in keys[1:]:
            if index == runs[-1][-1] + 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        blocks = []
        for run in runs:
            group = self._read_consecutive(self._blocks[layer], np.int32(run[0]), len(run),
                                           self.tp.sharding(1, "device"))
            blocks += [jax.tree.map(lambda g: g[j], group) for j in range(len(run))]
        return blocks

    @staticmethod
    @functools.partial(jax.jit, static_argnums=(2, 3))
    def _read_consecutive(layer, first: jax.Array, count: int, device):
        return jax.tree.map(lambda l: jax.device_put(jax.lax.dynamic_slice_in_dim(l, first, count), device), layer)

    def layer_buffer(self, layer: int) -> jax.Array:
        """The one buffer [num_blocks, *block_shape] of a "gpu" or "pages" layer (blocks past those the request
        wrote hold another request's data or zeros: the reader masks them by length)."""
        if self.places[layer] == "blocks":
            raise RuntimeError(f"Layer {layer} keeps one buffer per block, not one for the layer.")
        return self._blocks[layer]

    def gather_places(self, layer: int) -> tuple:
        """`gather_rows`'s (host, device) for a "gpu" or "pages" layer: where it lives and where its rows go. With one
        device, shardings; under tensor parallelism, memory spaces, for the gather each device runs on its own
        shard (inside `shard_map`)."""
        if self.tp.size == 1:
            return self.tp.sharding(None, self._sharding[layer].memory_kind), self.tp.sharding(None, "device")
        space = jax.memory.Space
        return space.Device if self._sharding[layer].memory_kind == "device" else space.Host, space.Device

    def reset(self) -> None:
        """Forgets every request: every block counts as unwritten again."""
        self._written[:] = False
        self.stop_mirror()

    def forget(self, blocks: Sequence[int]) -> None:
        """Forgets one request's blocks (in every layer) when it finishes or gives them up."""
        self._written[:, list(blocks)] = False

    def live_blocks(self) -> list[int]:
        """The blocks that hold live KV in some layer."""
        return np.flatnonzero(self._written.any(axis=0)).tolist()

    def mark_written(self, num_blocks: int) -> None:
        """Counts blocks 0..num_blocks-1 of every layer as live again (benchmarks re-read a finished request's
        blocks, which are still in place)."""
        self._written[:, :num_blocks] = True

    def host_bytes_held(self) -> int:
        return sum(b.nbytes for place, layer in zip(self.places, self._blocks) if place != "gpu"
                   for b in jax.tree.leaves(layer))

    def buffer_addresses(self) -> list[list[int]]:
        """Where each buffer lives: unchanged for the store's lifetime."""
        return [[b.unsafe_buffer_pointer() for b in jax.tree.leaves(layer)] for layer in self._blocks]


def in_device_memory(place) -> bool:
    """Whether `place` (a sharding or memory space, as `gather_places` gives) is GPU memory."""
    return getattr(place, "memory_kind", place) in ("device", jax.memory.Space.Device)


@functools.partial(jax.jit, static_argnums=(2, 3))
def gather_rows(layer, rows: jax.Array, host, device):
    """The 16-token pages `rows` (int32, anywhere; row (b * Hkv + h) * units + u is unit u of KV head h in block
    b) of a one-buffer layer kept in `host` (a sharding or memory space), on `device`: gathered on the host
    next to the pinned buffer, then one transfer. -> [len(rows), 2, PAGE_UNIT, D] (each leaf of a stored KV
    array). Called inside a jit, both join that program."""
    def take(layer, rows):
        return jax.tree.map(lambda l: l.reshape(-1, *l.shape[-3:]).at[rows].get(mode="promise_in_bounds"), layer)

    if in_device_memory(host):
        return take(layer, rows)
    return jax.device_put(_host_compute(take)(layer, jax.device_put(rows, host)), device)
