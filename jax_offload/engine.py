"""`LLM`: loads a model and runs requests: several together (continuous batching, `jax_offload.serving`), or one
after another (prefill, then token-by-token decode)."""
from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from convert.safetensors_loader import load_params
from jax_offload.attention import check_attention_impl, default_attention_impl
from jax_offload.blend import BlendRunner, Segments, SegmentStore
from jax_offload.config import EngineConfig, ModelConfig
from jax_offload.device_runner import DeviceRunner, pad_ids
from jax_offload.models import decoder
from jax_offload.models.params import ModelParams
from jax_offload.models.rope import inverse_frequencies
from jax_offload.offload_runner import OffloadRunner
from jax_offload.outputs import RequestDelta, RequestOutput
from jax_offload.precision import step_jit
from jax_offload.progress import prefill_bar
from jax_offload.sampling import SamplingParams
from jax_offload.serial_engine import SerialEngine
from jax_offload.serving.block_manager import cache_tag
from jax_offload.serving.engine import BatchEngine, EngineLoad, run_requests
from jax_offload.serving.model_runner import own_prefill_bytes
from jax_offload.serving.sequence import PromptKV
from jax_offload.sparse import xattention
from jax_offload.tensor_parallel import TensorParallel, check_devices, sharded_model_config, to_host
from pallas_kernels import decode_split_len

Prompt = str | Sequence[int] | Segments


class LLM:
    """A Hugging Face Llama / Qwen2 / Qwen3 checkpoint ready to generate.

    Several prompts run together (continuous batching, `jax_offload.serving`): with the KV cache in GPU memory over
    a paged pool allocated at the first such call and kept; offloaded, over the host store, which then holds
    `host_kv_tokens` tokens (default max_model_len) of all running requests together. One prompt also runs on the
    batch engine with its KV in GPU memory and the Pallas kernels, or with prefix caching; otherwise one prompt, and
    XAttention prefill in GPU memory, run requests one after another, each from a fresh KV cache.

    `num_decode_steps` N > 1 (KV in GPU memory): while every running request draws plainly (greedy or tempered, no
    log-probabilities), a decode runs N steps in one program, the same tokens with one host launch for N; a request
    that comes meanwhile waits for them (`BatchEngine`).

    `tensor_parallel_size` N splits every layer over N devices by KV-head groups (the KV cache too, offloaded or
    not, and the paged pool of continuous batching).

    `batch_invariant=True`, the default (it takes the Pallas kernels, the GPU's default): the weights are multiplied
    by a Pallas matmul whose per-element order does not depend on the row count (under tensor parallelism on each
    device's shard, the row-parallel products added in device order), and decode attention folds splits whose length
    follows the sequence's length alone (512 to 4,096 keys) in key order, so a request's bfloat16 tokens are the same
    alone, batched, after cached prefixes or offloaded in blocks of a multiple of 4,096 keys, the default (at a given
    tensor_parallel_size). `False` multiplies by XLA's dots (cuBLAS), whose order follows the batch: on an H200
    the invariant mode gives 0.97x its batched throughput (8B and 0.6B shapes), 1.03-1.04x its batch-1 decode at
    8K and 32K, 1.00-1.01x at 64K and 128K, 1.015x its 32K prefill (docs/exactness.md).

    `kv_cache_dtype="fp8"` or `"int8"`: K and V are stored as float8_e4m3fn or int8 with a power-of-two scale
    per token and KV head (`kv.kv_cache_dtype`): half the bytes in the host store, over PCIe and in the paged pool
    (int8 keeps NIAH accuracy on the default model where fp8 loses at 8K: README). They are rounded once, as they
    are projected, so offloaded and in-GPU runs read the same keys. "auto" keeps the model's dtype.

    `enable_prefix_caching=True`: every prompt runs on the batch engine, which keeps prompts' full KV blocks (in the
    GPU pool, or offloaded in the host store) keyed by their token prefix, and a prompt that starts like an earlier
    one reuses them and prefills only the rest (`RequestOutput.num_cached_tokens`). `prefix_cache_host_gb` > 0 (KV
    in GPU memory): blocks the pool must reuse keep their KV in that much pinned host memory and come back over
    PCIe on a later hit, instead of being recomputed.

    `Segments([...])` prompts (CacheBlend, `blend`; with prefix caching and a host tier, KV in GPU memory): each
    part's KV is computed alone once, kept in that host tier by its tokens, and reused wherever the part comes
    back; `blend_recompute_ratio` of a reused part's tokens are recomputed in context.
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        offload: bool = False,
        host_kv_tokens: int | None = None,
        block_size: int | None = None,
        num_ring_slots: int | None = None,
        prefill: str | None = None,
        sparse_policy: str | None = None,
        decode_policy: str | None = None,
        decode_budget: int | None = None,
        page_size: int | None = None,
        dense_layers: int | None = None,
        sparse_cache_gb: float | None = None,
        sketch_dtype: str | None = None,
        prefill_policy: str = "full",
        xattn_threshold: float | None = None,
        xattn_stride: int | None = None,
        xattn_block: int | None = None,
        xattn_density: float | None = None,
        attention_impl: str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        num_decode_steps: int = 1,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        batch_invariant: bool = True,
        enable_prefix_caching: bool = False,
        prefix_cache_host_gb: float = 0.0,
        kv_cache_dtype: str = "auto",
        blend_recompute_ratio: float = 0.15,
    ):
        from transformers import AutoTokenizer

        model_dir = Path(model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"Model directory {model_dir} does not exist.")
        model_config = ModelConfig.from_hf(model_dir)
        options = EngineConfig(
            dtype=dtype, max_model_len=max_model_len, offload=offload, host_kv_tokens=host_kv_tokens,
            block_size=block_size,
            num_ring_slots=num_ring_slots, prefill=prefill, sparse_policy=sparse_policy, decode_policy=decode_policy,
            decode_budget=decode_budget, page_size=page_size, dense_layers=dense_layers,
            sparse_cache_gb=sparse_cache_gb, sketch_dtype=sketch_dtype, prefill_policy=prefill_policy,
            xattn_threshold=xattn_threshold, xattn_stride=xattn_stride, xattn_block=xattn_block,
            xattn_density=xattn_density,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            num_decode_steps=num_decode_steps,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            batch_invariant=batch_invariant, enable_prefix_caching=enable_prefix_caching,
            prefix_cache_host_gb=prefix_cache_host_gb,
            kv_cache_dtype=kv_cache_dtype, blend_recompute_ratio=blend_recompute_ratio,
        )
        options = options.validate(model_config)
        check_attention_impl(attention_impl or default_attention_impl())
        check_devices(options.tensor_parallel_size)
        tp = TensorParallel.create(options.tensor_parallel_size)
        params = load_params(model_dir, model_config, jnp.dtype(dtype), tp)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = set(model_config.eos_token_ids)
        gen_cfg = model_dir / "generation_config.json"
        if gen_cfg.is_file():
            gen_eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self._setup(model_config, options, params, tokenizer, eos, attention_impl, tp)

    @classmethod
    def from_params(
        cls,
        model_config: ModelConfig,
        params: ModelParams,
        tokenizer=None,
        attention_impl: str | None = None,
        **options,
    ) -> "LLM":
        """An engine over parameters already in memory (e.g. random weights at a real shape, for benchmarks).
        Without a tokenizer, prompts must be token ids and outputs carry ids only. With `tensor_parallel_size` N the
        parameters must already be laid out for N devices (`LayerParams.num_shards`, placed on the mesh); on one
        device they are placed on the engine's one-device mesh, as loaded parameters are."""
        llm = cls.__new__(cls)
        engine = EngineConfig(**options).validate(model_config)
        n = engine.tensor_parallel_size
        check_devices(n)
        if params.layers and params.layers[0].num_shards != n:
            raise ValueError(
                f"The parameters are laid out for {params.layers[0].num_shards} devices, not tensor_parallel_size {n}."
            )
        tp = TensorParallel.create(n)
        if n == 1:  # on the mesh as loaded ones are: mixed placements beside the store's blocks compile again
            params = jax.device_put(params, tp.sharding(None))
        llm._setup(model_config, engine, params, tokenizer, set(model_config.eos_token_ids), attention_impl, tp)
        return llm

    def _setup(self, model_config, engine, params, tokenizer, eos_ids, attention_impl, tp: TensorParallel) -> None:
        self.attention_impl = check_attention_impl(attention_impl or default_attention_impl())
        # With fewer KV heads than devices, the devices hold repeated KV heads: the model as they run it.
        model_config = sharded_model_config(model_config, tp.size)
        self.tp = tp
        params = params.with_batch_invariance(engine.batch_invariant and self.attention_impl == "pallas", tp
                                              ).with_kv_cache_dtype(engine.kv_cache_dtype)
        self.model_config, self.engine_config, self.params, self.tokenizer = model_config, engine, params, tokenizer
        self.dtype = jnp.dtype(engine.dtype)
        self.eos_token_ids = frozenset(int(i) for i in eos_ids)
        self._inv_freq = tp.replicate(jnp.asarray(inverse_frequencies(model_config.rope, model_config.head_dim)))
        # Sparse decode policies run offloaded only: there are no in-GPU bits to match.
        if (engine.batch_invariant and engine.offload and self.attention_impl == "pallas"
                and engine.decode_policy == "full"):
            split = decode_split_len(engine.max_model_len)
            if engine.block_size % split:
                warnings.warn(f"batch_invariant with offload block_size {engine.block_size}: offloaded decode gives "
                              f"the in-GPU bits only with a multiple of {split} (the decode split at max_model_len "
                              f"{engine.max_model_len}); the default 4096 always does.", stacklevel=3)
        if engine.offload:
            self._runner = OffloadRunner(model_config, params, self._inv_freq, self.dtype, self.attention_impl, engine,
                                         tp)
        else:
            self._runner = DeviceRunner(model_config, params, self._inv_freq, self.dtype, self.attention_impl, tp,
                                        xattention.policy_of(engine))
        self._batch_engine: BatchEngine | None = None
        self._serial: SerialEngine | None = None
        self._blend: BlendRunner | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    # ---- prompts -------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a raw-text prompt (or the ids themselves, checked)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("This engine has no tokenizer; pass prompts as token ids.")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"Token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size}).")
        if not ids:
            raise ValueError("The prompt is empty; give at least one token.")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(ids)} tokens; max_model_len {self.max_model_len} leaves no room to generate."
            )
        return ids

    def chat_segments(self, parts: Sequence[str]) -> Segments:
        """One user message given in parts, as `Segments`: the chat template's head (a true prefix, reused as it
        is), the parts, the template's tail after the last part (computed with it)."""
        head, tail = template_ends(self.tokenizer)
        return Segments([head, *parts[:-1], parts[-1] + tail] if head else [*parts[:-1], parts[-1] + tail])

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_ids(self.tokenizer, messages)

    # ---- public API -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_text: Callable[[int, str], None] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generates for each prompt (raw text or token ids), outputs in prompt order; `params` is one
        SamplingParams for all or one per prompt; `on_text(i, delta)` streams prompt i's new text; `progress`
        shows a bar (requests done and output tokens/s, and the prefill of a long prompt run alone)."""
        if isinstance(prompts, (str, Segments)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))
        ):
            prompts = [prompts]
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            params = list(params)
            if len(params) != len(prompts):
                raise ValueError(f"Got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one each.")
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if any(isinstance(p, Segments) for p in prompts):
            pairs = [self._blend_prompt(p) if isinstance(p, Segments) else (self.encode(p), None) for p in prompts]
            return self._batch().generate([ids for ids, _ in pairs], params, on_text, progress,
                                          [blend for _, blend in pairs])
        encoded = [self.encode(p) for p in prompts]
        if len(encoded) > 1 or self._single_prompt_batches():
            return self._batch().generate(encoded, params, on_text, progress, [self._own_prefill(e) for e in encoded])
        engine = self._serial_engine()
        # The one-request path shares the offloaded store with the batch engine's requests: it must not run among them.
        if engine.has_unfinished() or (self._batch_engine is not None and self._batch_engine.has_unfinished()):
            raise RuntimeError("generate needs an idle engine; this one still has requests added by add_request.")
        engine.progress = progress
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for rid, prompt_ids, p in zip(ids, encoded, each):
            engine.add_request(rid, prompt_ids, p)
        return run_requests(engine, ids, on_text)

    # ---- the incremental API (vLLM's LLMEngine shape), what the server drives ---------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queues a request; it joins the running requests at a coming `step` (the batch engine's continuous
        batching)."""
        if isinstance(prompt, Segments):
            prompt_ids, blend = self._blend_prompt(prompt)
            self._batch().add_request(request_id, prompt_ids, params, blend)
        else:
            ids = self.encode(prompt)
            self._batch().add_request(request_id, ids, params, self._own_prefill(ids))

    def step(self) -> list[RequestDelta]:
        """One step of the request engine: what it added to each request."""
        return self.request_engine().step()

    def step_due(self) -> float | None:
        """When a server's loop should run the next step if it should wait for requests first
        (`BatchEngine.step_due`); None: at once."""
        return self.request_engine().step_due()

    def abort(self, request_id: str) -> None:
        """Drops a request wherever it is; its KV is free at once."""
        self.request_engine().abort(request_id)

    def has_unfinished(self) -> bool:
        return self.request_engine().has_unfinished()

    def warm_up(self) -> None:
        """Compiles what the request engine will run (the batch engine's steps at every batch size and prefill
        length), so a server's first requests wait for no compile."""
        self.request_engine().warm_up()

    def load(self) -> EngineLoad:
        """Requests running, waiting and swapped, and the KV they hold (the server's metrics)."""
        return self.request_engine().load()

    def host_store_bytes(self) -> tuple[int, int]:
        """(bytes read from, bytes written to) the offloaded KV store so far; (0, 0) with the KV in GPU memory."""
        store = getattr(self._runner, "store", None)
        return (store.bytes_read, store.bytes_written) if store is not None else (0, 0)

    def request_engine(self) -> BatchEngine:
        """The engine `add_request` feeds: the batch engine, whatever the options (the one-request path serves
        `generate` of one prompt where `_single_prompt_batches` says so)."""
        return self._batch()

    def _serial_engine(self) -> SerialEngine:
        if self._serial is None:
            self._serial = SerialEngine(self)
        return self._serial

    def _blend_prompt(self, prompt: Segments) -> tuple[list[int], Callable[[int], PromptKV]]:
        """(token ids, CacheBlend prefill: `Sequence.own_prefill`) of a `Segments` prompt, which runs on the batch
        engine."""
        parts = [self.encode(part) for part in prompt.parts]
        return self.encode([t for part in parts for t in part]), functools.partial(self._blend_runner().prefill, parts)

    def _own_prefill(self, ids: list[int]) -> Callable[[int], PromptKV] | None:
        """A prompt's own prefill on the batch engine (`Sequence.own_prefill`): in GPU memory with XAttention, the
        one-request runner's (its estimate and block choice over the whole prompt), in a step of its own; None for
        a prefill the batch engine runs itself."""
        e = self.engine_config
        if e.offload or e.prefill_policy != "xattention":
            return None
        return functools.partial(self._xattention_prompt_kv, ids)

    def _xattention_prompt_kv(self, ids: list[int], total_len: int) -> PromptKV:
        hidden, _ = self._prefill(ids, total_len)
        k, v = self._runner.take_cache()
        last = len(ids) - 1
        return PromptKV(hidden[:, last:last + 1], k, v, 0, self._prefill_density())

    def _blend_runner(self) -> BlendRunner:
        e = self.engine_config
        if e.offload or self.tp.size > 1 or e.prefill_policy != "full" or not e.enable_prefix_caching \
                or not e.prefix_cache_host_gb:
            raise ValueError(
                "Segments prompts run with the KV cache in GPU memory on one device, full prefill, "
                "enable_prefix_caching=True and prefix_cache_host_gb > 0 (where their KV is kept); got "
                f"offload={e.offload}, tensor_parallel_size={self.tp.size}, prefill_policy={e.prefill_policy!r}, "
                f"enable_prefix_caching={e.enable_prefix_caching}, prefix_cache_host_gb={e.prefix_cache_host_gb}.")
        if self._blend is None:
            self._blend = BlendRunner(self.model_config, self.params, self._inv_freq, self.dtype, self.attention_impl,
                                      SegmentStore(int(e.prefix_cache_host_gb * 2**30)), e.blend_recompute_ratio,
                                      cache_tag(self.model_config, self.dtype, e.kv_cache_dtype))
        return self._blend

    def _single_prompt_batches(self) -> bool:
        """Whether one prompt runs on the batch engine too: with its KV in GPU memory and the Pallas kernels, its
        decode is one compiled step for the whole model, where the per-request path dispatches a call per layer
        and token (H200, 8B at 8K: 4.8 vs 9.3 ms per token), and a prompt longer than a prefill step is prefilled
        in chunks. The per-request path keeps the XLA twins (CPU), whose paged step grows with the pool's size
        (smoke model: 0.3 ms with 3 blocks, 29 ms with 768). An XAttention prompt alone keeps the per-request path:
        on the batch engine its one-request prefill needs room beside a pool (`own_prefill_bytes`), so the longest
        prompt that fits would be shorter. Offloaded with sketch or Quest decode on the Pallas kernels, a prompt alone
        runs there too: its steps run ahead and its sparse layers go six to a program (H200, 8B shape, 128K, sketch:
        10.38 ms per token against 12.85 on the per-request path, medians of 5 runs). With prefix caching every prompt
        runs there, where the cached blocks are."""
        e = self.engine_config
        return (not e.offload and self.attention_impl == "pallas" and e.prefill_policy == "full") \
            or (e.offload and self.attention_impl == "pallas" and e.decode_policy in ("sketch", "quest")) \
            or e.enable_prefix_caching

    def _batch(self) -> BatchEngine:
        if self._batch_engine is None:
            e = self.engine_config
            shared = dict(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                          gpu_memory_utilization=e.gpu_memory_utilization)
            if e.offload:
                self._batch_engine = BatchEngine.offloaded(self._runner, self.max_model_len, self.tokenizer,
                                                           self.eos_token_ids,
                                                           enable_prefix_caching=e.enable_prefix_caching, **shared)
            else:
                self._batch_engine = BatchEngine.in_gpu(
                    self.model_config, self.params, self._inv_freq, self.dtype, self.attention_impl,
                    self.max_model_len, self.tokenizer, self.eos_token_ids, tp=self.tp,
                    enable_prefix_caching=e.enable_prefix_caching,
                    prefix_cache_host_bytes=int(e.prefix_cache_host_gb * 2**30), num_decode_steps=e.num_decode_steps,
                    # An XAttention prompt's prefill (the one-request runner's) needs room beside the pool.
                    reserve_bytes=own_prefill_bytes(self.model_config, self.dtype, self.max_model_len, self.tp.size)
                    if e.prefill_policy == "xattention" else 0, **shared)
        return self._batch_engine

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation (or a list of them) and generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], params, on_text)

    def logits(self, token_ids: Sequence[int], last: int | None = None) -> np.ndarray:
        """float32 [n, vocab]: the prefill logits at every position, or at the `last` n positions only (a long
        prompt's full logits would not fit in memory)."""
        ids = self.encode(list(token_ids))
        if last is not None and not 1 <= last <= len(ids):
            raise ValueError(f"last must be between 1 and the prompt length {len(ids)}, got {last!r}.")
        start = 0 if last is None else len(ids) - last
        if self.engine_config.offload and self._batch_engine is not None:
            self._batch_engine.blocks.forget_cached()  # the one-request prefill below writes over the store
        try:
            hidden, first = self._prefill(ids, len(ids), keep_all=last is None)
            if first > start:  # the runner kept too few rows: run again keeping them all
                self._runner.finish()
                hidden, first = self._prefill(ids, len(ids), keep_all=True)
            rows = jax.lax.slice_in_dim(hidden, start - first, len(ids) - first, axis=1)
            return to_host(_all_logits(self.model_config, self.params, rows)[0])
        finally:
            self._runner.finish()

    # ---- one request ----------------------------------------------------------------------------

    def _prefill(
        self, ids: list[int], total_len: int, progress: bool = False, keep_all: bool = False
    ) -> tuple[jax.Array, int]:
        padded = pad_ids(ids, self._runner.padded_length(len(ids)))
        with prefill_bar(len(ids), progress) as bar:
            return self._runner.prefill(padded, len(ids), total_len, bar, keep_all)

    def _last_logits(self, hidden: jax.Array, row: np.int32) -> jax.Array:
        """float32 [vocab] logits of hidden state row `row` (of batch row 0)."""
        return _last_logits(self.model_config, self.params, hidden, row)

    def _prefill_density(self) -> list[float] | None:
        if self.engine_config.prefill_policy != "xattention":
            return None
        return xattention.density(self._runner.prefill_block_counts)


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def template_ends(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after one user message (the assistant's turn opened); no template:
    ("", "\n")."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "", "\n"
    mark = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


@functools.partial(step_jit, static_argnums=0)
def _all_logits(cfg: ModelConfig, params, hidden: jax.Array) -> jax.Array:
    return decoder.logits(cfg, params, hidden)


@functools.partial(step_jit, static_argnums=0)
def _last_logits(cfg: ModelConfig, params, hidden: jax.Array, row: jax.Array) -> jax.Array:
    return decoder.logits(cfg, params, jax.lax.dynamic_index_in_dim(hidden[0], row, keepdims=False))
