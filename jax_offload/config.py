"""Model configuration read from a Hugging Face `config.json`, and the engine's options."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jax_offload.kv.kv_cache_dtype import check_kv_cache_dtype

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
PREFILL_MODES = ("chunked", "layerwise")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()

    def tensor_parallel_sizes(self) -> list[int]:
        """Device counts the model splits over: each must give every device whole query heads and the KV heads
        they read (a divisor of the KV heads, or a multiple of them, each KV head then repeated on N / Hkv
        devices as vLLM does) and an equal slice of the MLP."""
        return [n for n in range(1, self.num_heads + 1)
                if self.num_heads % n == 0 and (self.num_kv_heads % n == 0 or n % self.num_kv_heads == 0)
                and self.intermediate_size % n == 0]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers at 2 bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @classmethod
    def from_hf(cls, path: str | Path) -> "ModelConfig":
        """Reads a Hugging Face `config.json` (a file or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"No config.json at {path}; pass a Hugging Face model directory.")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}).") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        model_type = SUPPORTED_ARCHITECTURES.get(arch) if arch else None
        if model_type is None or raw.get("model_type", model_type) != model_type:
            raise ValueError(
                f"Unsupported model (architectures={archs}, model_type={raw.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is supported.")
        if raw.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; only full attention is.")
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_rope_from_dict(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type != "llama")),
            # Qwen2 has q/k/v bias; Llama carries `attention_bias`; Qwen3 has none.
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
        )


def _rope_from_dict(raw: dict) -> RopeConfig:
    # transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x may write `rope_parameters`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params.update(scaling)
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


# Options that only mean something when the KV cache is offloaded, with their defaults there. 16 ring slots: a
# decode step dispatches a call and starts transfers per group of slots / 2 blocks, and with 4 slots that host work,
# not PCIe, set the pace (8B shape at 128K: 1.06x -> 1.00x the PCIe floor on an H200 in two calls; 350 -> 315 ms on
# an H100, and 341 -> 206 ms at tensor parallel size 2: bench/results/runs/h100x2_tp_decode); the slots cost a few
# hundred MiB at most. 4096-token blocks: a chunked prefill reads every earlier block back per chunk and a decode step
# dispatches per group, so 1024-token blocks cost 4x the prefill and 1.2-1.8x the decode at 127K on the 8B shape
# (H100: 55 s against 14 s in two runs each, 640 against 373 ms/token, bench/results/runs/h100_decode_defaults/),
# while every benchmark ran 4096; a GPU tail block of every layer per running request (8B shape: 0.5 GiB) is their
# cost.
OFFLOAD_DEFAULTS = {"block_size": 4096, "num_ring_slots": 16, "prefill": "chunked", "decode_policy": "full"}
# Options of the page-choosing decode policies (sketch and Quest), with their defaults.
# sparse_cache_gb: GiB of GPU memory keeping chosen pages (`sparse.page_cache`), 0 for none.
PAGE_POLICY_DEFAULTS = {"decode_budget": 4096, "page_size": 16, "dense_layers": 2, "sparse_cache_gb": 0.0}
PAGE_POLICIES = ("sketch", "quest")
DECODE_POLICIES = ("full",) + PAGE_POLICIES
SKETCH_DTYPES = ("int4", "int8")
SKETCH_DEFAULTS = {"sketch_dtype": "int4"}
# Options of XAttention prefill (offloaded or not), with their defaults. Threshold 0.95: on the default model 0.9
# loses 6-7 NIAH points at 8K and 0.95 about 2 (bench/results/runs/h100_sketch_oracle/README.md).
XATTN_DEFAULTS = {"xattn_threshold": 0.95, "xattn_stride": 8, "xattn_block": 128}
# Instead of a threshold, a fixed density: this fraction of each query block's visible key blocks (the heaviest
# by the estimate, sink and diagonal included), whatever the scores; the cost of a prefill is then known ahead.
XATTN_DENSITY = "xattn_density"
PREFILL_POLICIES = ("full", "xattention")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Options of `LLM` that decide where the KV cache lives, how prefill runs and which KV decode reads.
    Offload-only options are None unless given; `validate` fills in their defaults. `sparse_policy` is the old
    name of `decode_policy`."""

    dtype: str = "bfloat16"
    max_model_len: int | None = None
    offload: bool = False
    # Offloaded: tokens of KV the pinned host store holds for all running requests together (default: max_model_len;
    # more lets several long requests decode together, each still at most max_model_len).
    host_kv_tokens: int | None = None
    block_size: int | None = None
    num_ring_slots: int | None = None
    prefill: str | None = None
    sparse_policy: str | None = None
    decode_policy: str | None = None
    decode_budget: int | None = None
    page_size: int | None = None
    dense_layers: int | None = None
    sparse_cache_gb: float | None = None
    sketch_dtype: str | None = None
    prefill_policy: str = "full"
    xattn_threshold: float | None = None
    xattn_stride: int | None = None
    xattn_block: int | None = None
    xattn_density: float | None = None
    # Continuous batching (several prompts, KV in GPU memory or offloaded): running requests at most, tokens per
    # prefill step (padding included), and the share of device memory the weights and the paged KV pool may fill.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.9
    # Decode steps one program may run in GPU memory while every running request draws plainly (`BatchEngine`).
    num_decode_steps: int = 1
    # Devices the model's heads and MLP are split over (tensor parallelism).
    tensor_parallel_size: int = 1
    # A request's tokens independent of the requests run with it (see `LLM`).
    batch_invariant: bool = True
    # Reuse the KV blocks of earlier prompts' equal prefixes (continuous batching's GPU pool or host store; see `LLM`).
    enable_prefix_caching: bool = False
    # GiB of pinned host memory that keep prefix-cache blocks evicted from the GPU pool, to copy back on a hit.
    prefix_cache_host_gb: float = 0.0
    # How the KV cache stores K and V: "auto" (the model's dtype), "fp8" or "int8" (`kv.kv_cache_dtype`).
    kv_cache_dtype: str = "auto"
    # CacheBlend: the share of a reused segment's tokens recomputed from layer 1 on (`blend`).
    blend_recompute_ratio: float = 0.15

    def validate(self, model: ModelConfig) -> "EngineConfig":
        """Checks every option; returns a copy with `max_model_len` and the offload defaults filled in."""
        config = self
        if self.sparse_policy is not None:
            if self.decode_policy not in (None, self.sparse_policy):
                raise ValueError(
                    f"sparse_policy={self.sparse_policy!r} and decode_policy={self.decode_policy!r} disagree; "
                    "sparse_policy is the old name of decode_policy, give one."
                )
            config = dataclasses.replace(self, decode_policy=self.sparse_policy, sparse_policy=None)
        offload_only = ["host_kv_tokens", *OFFLOAD_DEFAULTS, *PAGE_POLICY_DEFAULTS, *SKETCH_DEFAULTS]
        given = [name for name in offload_only if getattr(config, name) is not None]
        if not config.offload and given:
            raise ValueError(
                f"{_names_apply(given)} only to an offloaded KV cache; pass offload=True or leave "
                f"{'it' if len(given) == 1 else 'them'} out."
            )
        config = config._with_prefill_policy()
        if not config.offload:
            return config._validate(model)
        filled = {name: default for name, default in OFFLOAD_DEFAULTS.items() if getattr(config, name) is None}
        if "num_ring_slots" in filled:
            # Under tensor parallelism a slot holds 1/tp of a block: tp times the slots keep the ring as deep in
            # bytes per device (2 x H100, 128K decode at TP=2: 32 slots 1.05x the links' floor and 0.526x TP=1,
            # 16 slots 0.549x, bench/results/runs/h100x2_tp_ring/).
            filled["num_ring_slots"] *= config.tensor_parallel_size
        if "prefill" in filled and config.prefill_policy == "xattention":
            # Chunked XAttention streams every earlier block of a layer for each chunk (as full chunked prefill
            # does), while layerwise moves no earlier block at all; it measured faster when chunks streamed the
            # chosen blocks a second time (bench/results/sparse.md), and has not been measured against since.
            filled["prefill"] = "layerwise"
        config = dataclasses.replace(config, **filled)
        if config.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_policy {config.decode_policy!r} is unknown; valid: {', '.join(DECODE_POLICIES)}.")
        page_given = [name for name in PAGE_POLICY_DEFAULTS if getattr(config, name) is not None]
        if config.decode_policy not in PAGE_POLICIES and page_given:
            raise ValueError(f"{_names_apply(page_given)} only with decode_policy 'sketch' or 'quest', "
                             f"got {config.decode_policy!r}.")
        if config.decode_policy != "sketch" and config.sketch_dtype is not None:
            raise ValueError(f"sketch_dtype applies only with decode_policy='sketch', got {config.decode_policy!r}.")
        defaults = {}
        if config.decode_policy in PAGE_POLICIES:
            defaults |= PAGE_POLICY_DEFAULTS
        if config.decode_policy == "sketch":
            defaults |= SKETCH_DEFAULTS
        config = dataclasses.replace(config, **{n: d for n, d in defaults.items() if getattr(config, n) is None})
        return config._validate(model)

    def _with_prefill_policy(self) -> "EngineConfig":
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy {self.prefill_policy!r} is unknown; valid: {', '.join(PREFILL_POLICIES)}.")
        given = [name for name in (*XATTN_DEFAULTS, XATTN_DENSITY) if getattr(self, name) is not None]
        if self.prefill_policy != "xattention":
            if given:
                raise ValueError(f"{_names_apply(given)} only with prefill_policy='xattention', "
                                 f"got {self.prefill_policy!r}.")
            return self
        defaults = {n: d for n, d in XATTN_DEFAULTS.items() if getattr(self, n) is None}
        density = self.xattn_density
        if density is not None:  # the density decides instead of a threshold
            if self.xattn_threshold is not None:
                raise ValueError(f"xattn_threshold ({self.xattn_threshold!r}) and xattn_density ({density!r}) each "
                                 "decide what XAttention keeps; give one.")
            if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
                raise ValueError(f"xattn_density must be a number in (0, 1], got {density!r}.")
            del defaults["xattn_threshold"]
        config = dataclasses.replace(self, **defaults)
        t, stride, block = config.xattn_threshold, config.xattn_stride, config.xattn_block
        if density is None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1):
            raise ValueError(f"xattn_threshold must be a number in (0, 1], got {t!r}.")
        if not _int(block) or block < 16 or block & (block - 1):
            raise ValueError(f"xattn_block must be a power of two >= 16, got {block!r}.")
        if not _int(stride) or stride < 1 or stride & (stride - 1) or stride > block:
            raise ValueError(f"xattn_stride must be a power of two that divides xattn_block {block}, got {stride!r}.")
        if density is not None:
            return dataclasses.replace(config, xattn_density=float(density))
        return dataclasses.replace(config, xattn_threshold=float(t))

    def _validate(self, model: ModelConfig) -> "EngineConfig":
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}.")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}.")
        if self.enable_prefix_caching and self.offload and self.prefill_policy != "full":
            raise ValueError(
                f"enable_prefix_caching=True with offload=True needs prefill_policy 'full' (XAttention's estimate "
                f"reads the whole prompt), got {self.prefill_policy!r}.")
        r = self.blend_recompute_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"blend_recompute_ratio must be a number in [0, 1], got {r!r}.")
        gb = self.prefix_cache_host_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or gb < 0:
            raise ValueError(f"prefix_cache_host_gb must be a number >= 0, got {gb!r}.")
        if gb and not self.enable_prefix_caching:
            raise ValueError(
                f"prefix_cache_host_gb={gb!r} keeps evicted prefix-cache blocks: it needs enable_prefix_caching=True.")
        if gb and self.offload:
            raise ValueError("prefix_cache_host_gb keeps blocks evicted from the GPU pool; an offloaded KV cache "
                             f"keeps its prefixes in its host store already: leave it 0, got {gb!r}.")
        n = self.tensor_parallel_size
        if not _int(n) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}.")
        if n not in model.tensor_parallel_sizes():
            raise ValueError(
                f"tensor_parallel_size {n} does not split the model's {model.num_kv_heads} KV heads, {model.num_heads} "
                f"attention heads and MLP of {model.intermediate_size}; valid sizes: "
                f"{', '.join(map(str, model.tensor_parallel_sizes()))}."
            )
        if self.decode_policy in PAGE_POLICIES and n > model.num_kv_heads:
            # Repeated KV heads would each choose pages for only part of their query group.
            raise ValueError(
                f"decode_policy={self.decode_policy!r} with tensor_parallel_size {n} needs at least {n} KV heads; the model has "
                f"{model.num_kv_heads} (use tensor_parallel_size <= {model.num_kv_heads} or decode_policy='full')."
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_decode_steps"):
            value = getattr(self, name)
            if not _int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.num_decode_steps > 1 and self.offload:
            raise ValueError(f"num_decode_steps={self.num_decode_steps} runs decode steps in GPU memory; with "
                             "offload=True it must be 1.")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}.")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} is not supported; use float32, bfloat16 or float16.")
        max_len = self.max_model_len if self.max_model_len is not None else model.max_position_embeddings
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}.")
        if max_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"{model.max_position_embeddings}."
            )
        if self.offload:
            if not _int(self.block_size) or self.block_size < 16 or self.block_size % 16:
                raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size!r}.")
            if not _int(self.num_ring_slots) or self.num_ring_slots < 1:
                raise ValueError(f"num_ring_slots must be an integer >= 1, got {self.num_ring_slots!r}.")
            if self.prefill not in PREFILL_MODES:
                raise ValueError(f"prefill mode {self.prefill!r} is unknown; valid: {', '.join(PREFILL_MODES)}.")
            if self.prefill_policy == "xattention" and self.block_size % self.xattn_block:
                raise ValueError(
                    f"xattn_block {self.xattn_block} must divide block_size {self.block_size} with an offloaded KV cache."
                )
        if self.decode_policy == "sketch" and self.sketch_dtype not in SKETCH_DTYPES:
            raise ValueError(f"sketch_dtype {self.sketch_dtype!r} is unknown; valid: {', '.join(SKETCH_DTYPES)}.")
        if self.decode_policy in PAGE_POLICIES:
            if not _int(self.page_size) or self.page_size < 16 or self.page_size % 16 or self.block_size % self.page_size:
                raise ValueError(
                    f"page_size must be a multiple of 16 that divides block_size {self.block_size}, got {self.page_size!r}."
                )
            if not _int(self.decode_budget) or self.decode_budget < self.page_size or self.decode_budget % self.page_size:
                raise ValueError(
                    f"decode_budget must be a positive multiple of page_size {self.page_size}, got {self.decode_budget!r}."
                )
            if not isinstance(self.sparse_cache_gb, (int, float)) or isinstance(self.sparse_cache_gb, bool) \
                    or not 0 <= self.sparse_cache_gb < float("inf"):
                raise ValueError(f"sparse_cache_gb must be a number of GiB >= 0, got {self.sparse_cache_gb!r}.")
            if not _int(self.dense_layers) or not 0 <= self.dense_layers <= model.num_layers:
                raise ValueError(
                    f"dense_layers must be an integer from 0 to the model's {model.num_layers} layers, "
                    f"got {self.dense_layers!r}."
                )
        host_tokens = max_len if self.host_kv_tokens is None else self.host_kv_tokens
        if self.offload and (not _int(host_tokens) or host_tokens < max_len):
            raise ValueError(f"host_kv_tokens must be an integer >= max_model_len {max_len} (one request's most), "
                             f"got {self.host_kv_tokens!r}.")
        return dataclasses.replace(self, max_model_len=max_len, host_kv_tokens=host_tokens if self.offload else None)


def _names_apply(names: list[str]) -> str:
    """'a applies' or 'a, b apply': option names with their verb."""
    return f"{', '.join(names)} {'applies' if len(names) == 1 else 'apply'}"


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)
