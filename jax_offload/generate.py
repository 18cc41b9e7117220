"""Command line: `python -m jax_offload.generate --prompt "..."` streams a completion and its speed;
`--prompt-file prompts.jsonl` runs many prompts together (continuous batching)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

COMPILATION_CACHE_BYTES = 2 * 2**30


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(prog="python -m jax_offload.generate", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path,
                     help="a .jsonl file: one prompt per line (a JSON string, or an object with a 'prompt' string or "
                          "a 'segments' list of strings: parts whose KV is reused where they come back, CacheBlend), "
                          "run together; any other file: its whole text is one prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON line per output instead of streaming")
    add_engine_options(p)
    return p


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The model and engine options, shared by the CLI and the server (`jax_offload.serve`): one definition."""
    p.add_argument("--model", type=Path, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--compilation-cache-dir",
                   help="where compiled programs are kept for the next run ('' for nowhere; default "
                        "$JAX_OFFLOAD_CACHE/xla, or JAX_COMPILATION_CACHE_DIR where set)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--offload", action="store_true", help="keep the KV cache in pinned host memory")
    p.add_argument("--host-kv-tokens", type=int,
                   help="offload: tokens of KV the pinned host store holds for all running requests together "
                        "(default: --max-model-len)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (offload; default 4096)")
    p.add_argument("--ring-slots", type=int,
                   help="GPU slots the KV blocks stream through (offload; default 16 x the tensor parallel size)")
    p.add_argument("--prefill", help="chunked or layerwise (offload; default chunked, layerwise with XAttention)")
    p.add_argument("--decode-policy",
                   help="full, sketch or quest: which host KV decode reads (offload; default full)")
    p.add_argument("--sparse-policy", dest="decode_policy", help=argparse.SUPPRESS)  # the old name
    p.add_argument("--decode-budget", type=int,
                   help="sketch, quest: tokens of host KV each KV head reads per step (4096)")
    p.add_argument("--page-size", type=int, help="sketch, quest: tokens per page (16)")
    p.add_argument("--dense-layers", type=int,
                   help="sketch, quest: first layers kept in GPU memory and read in full (2)")
    p.add_argument("--sparse-cache-gb", type=float,
                   help="sketch, quest: GiB of GPU memory keeping recently chosen pages; only new ones cross "
                        "PCIe (0: none)")
    p.add_argument("--sketch-dtype", help="sketch: int4 or int8, the key sketch's codes (int4)")
    p.add_argument("--prefill-policy", default="full", help="full or xattention: which blocks prefill attends")
    p.add_argument("--xattn-threshold", type=float, help="xattention: softmax mass each query block keeps (0.95)")
    p.add_argument("--xattn-stride", type=int, help="xattention: antidiagonal stride of the estimate (8)")
    p.add_argument("--xattn-block", type=int, help="xattention: tokens per selection block (128)")
    p.add_argument("--xattn-density", type=float,
                   help="xattention: instead of a threshold, this fraction of each query block's key blocks")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="running requests at most (256; the CLI: at most its number of prompts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="several prompts: tokens per prefill step, padding included (16384)")
    p.add_argument("--num-decode-steps", type=int, default=1,
                   help="several prompts in GPU memory: decode steps one program runs while every request draws "
                        "plainly; more spares a small batch the host's launches, a new request waits for them (1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="several prompts: share of GPU memory for weights and the paged KV pool (0.9)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices each layer is split over by KV-head groups (1); with several processes, all of them")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="a request's tokens independent of the requests run with it (on); --no-batch-invariant: "
                        "cuBLAS's matmuls, ~3%% more batched throughput, tokens that may change with the batch")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="how the KV cache stores K and V: auto (the model's dtype), fp8 (float8_e4m3fn) or int8, "
                        "the last two with a scale per token and KV head: half the memory and PCIe bytes")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse the KV of earlier prompts' equal prefixes, in GPU memory or offloaded (off)")
    p.add_argument("--prefix-cache-host-gb", type=float, default=0.0,
                   help="with prefix caching: GiB of pinned host memory keeping blocks evicted from the GPU pool (0)")
    p.add_argument("--blend-recompute-ratio", type=float, default=0.15,
                   help="'segments' prompts (CacheBlend): share of a reused part's tokens recomputed (0.15)")

# The options of add_engine_options that LLM takes under the same name.
_LLM_OPTIONS = (
    "max_model_len", "offload", "host_kv_tokens", "block_size", "prefill", "decode_policy", "decode_budget",
    "page_size", "dense_layers", "sparse_cache_gb", "sketch_dtype", "prefill_policy", "xattn_threshold",
    "xattn_stride", "xattn_block", "xattn_density", "max_num_seqs", "max_num_batched_tokens",
    "num_decode_steps", "gpu_memory_utilization", "tensor_parallel_size", "batch_invariant", "enable_prefix_caching",
    "prefix_cache_host_gb", "kv_cache_dtype", "blend_recompute_ratio",
)


def load_llm(args: argparse.Namespace, quiet: bool = False):
    """The `LLM` the engine options ask for (the default model, fetched once, if none is named)."""
    import jax

    from jax_offload import LLM
    from jax_offload.default_model import ensure_default_model

    model_dir = args.model if args.model is not None else ensure_default_model(quiet=quiet)
    if args.offload:
        _make_room_for_pinned_kv(model_dir, args)
    _keep_compiled_programs(args.compilation_cache_dir)
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    return LLM(model_dir, dtype=dtype, num_ring_slots=args.ring_slots,
               **{name: getattr(args, name) for name in _LLM_OPTIONS})


def _make_room_for_pinned_kv(model_dir: Path, args: argparse.Namespace) -> None:
    """Raises XLA's pinned host pool limit (read when JAX starts its GPU backend, so before that) to what the offloaded
    KV store of --host-kv-tokens (default --max-model-len) tokens takes, when that is past the default and the
    user set none. With a page policy (sketch, Quest) and chunked prefill, it also makes room for the prefill
    mirror (a second copy of the page layers' blocks while a prompt is prefilled, `HostKVStore.start_mirror`), as
    far as the host's memory goes: without it those layers' reads are serialized with compute on some hosts."""
    from jax_offload.config import OFFLOAD_DEFAULTS, PAGE_POLICIES, PAGE_POLICY_DEFAULTS, ModelConfig, round_up
    from jax_offload.kv import host_store
    from jax_offload.kv.kv_cache_dtype import KV_CACHE_DTYPES

    if host_store.PINNED_LIMIT_VAR in os.environ:
        return
    cfg = ModelConfig.from_hf(model_dir)
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        return  # LLM names the allowed values
    tokens = round_up(args.host_kv_tokens or args.max_model_len or cfg.max_position_embeddings,
                      args.block_size or OFFLOAD_DEFAULTS["block_size"])
    # The model's dtype is at most 2 bytes an element on a GPU (bfloat16 or float16).
    shape = (cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim, args.kv_cache_dtype, "bfloat16")
    with_mirror = None
    chunked = args.prefill == "chunked" or (args.prefill is None and args.prefill_policy != "xattention")
    if args.decode_policy in PAGE_POLICIES and chunked:
        page_layers = cfg.num_layers - (args.dense_layers if args.dense_layers is not None
                                        else PAGE_POLICY_DEFAULTS["dense_layers"])
        with_mirror = host_store.pinned_bytes(*shape, mirror_layers=max(page_layers, 0))
    gib = host_store.pinned_limit_gb(host_store.pinned_bytes(*shape), with_mirror)
    if gib > host_store.DEFAULT_PINNED_LIMIT_GB:
        os.environ[host_store.PINNED_LIMIT_VAR] = str(gib)


def _keep_compiled_programs(path: str | None) -> None:
    """JAX's persistent compilation cache: a later run of the same configuration loads its programs instead of
    compiling them again (and, on a GPU, XLA's autotuning results), up to COMPILATION_CACHE_BYTES, the least
    recently used dropped first. An explicit JAX_COMPILATION_CACHE_DIR, or a cache the calling program configured
    already (`main` called as a function), wins over the default."""
    import jax

    from jax_offload.default_model import cache_root

    if path is None:
        if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
            return
        path = str(cache_root() / "xla")
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however quick to compile: a first answer is many small ones.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)


def read_prompts(path: Path) -> list[str | list[str]]:
    """The prompts of a --prompt-file: one per line of a .jsonl file (a list of strings for a line with
    "segments"), else the file's whole text."""
    text = path.read_text()
    if path.suffix != ".jsonl":
        return [text]
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number} is not valid JSON ({err}).") from None
        prompt = item.get("segments", item.get("prompt")) if isinstance(item, dict) else item
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                            and all(isinstance(part, str) for part in prompt))):
            raise ValueError(f"{path} line {number} must be a JSON string or an object with a 'prompt' string or a "
                             f"'segments' list of strings, got {line.strip()[:60]!r}.")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts; write one JSON string per line.")
    return prompts


def main(argv: list[str] | None = None) -> int:
    # transformers serves only tokenizers and configs here; its "PyTorch was not found" advice is noise.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    # Parameters are checked before anything heavy is loaded.
    from jax_offload.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.prompt_file is not None:
        prompts = read_prompts(args.prompt_file)
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        raise ValueError("give a prompt with --prompt TEXT or --prompt-file PATH")
    empty = [i for i, p in enumerate(prompts) if not all(part.strip() for part in ([p] if isinstance(p, str) else p))]
    if empty:
        where = "the prompt" if len(prompts) == 1 else f"prompt {empty[0] + 1}"
        raise ValueError(f"{where} is empty; give text that is not only whitespace")

    from jax_offload import Segments

    # A run of N prompts never has more than N running: no GPU memory for more (offloaded, each is a tail slot of
    # every layer; a long prompt's prefill can use what is left, `HostKVStore.start_mirror`).
    args.max_num_seqs = min(args.max_num_seqs, len(prompts))
    llm = load_llm(args, quiet=args.json)
    chat = not args.no_chat_template

    def prepared(p):
        if not isinstance(p, str):
            return llm.chat_segments(p) if chat else Segments(p)
        return llm.apply_chat_template([{"role": "user", "content": p}]) if chat else llm.encode(p)

    ids = [prepared(p) for p in prompts]
    if len(ids) == 1 and not args.json:
        out = llm.generate(ids, params, on_text=lambda _, delta: print(delta, end="", flush=True), progress=True)[0]
        print(
            f"\n[prefill {len(out.prompt_token_ids)} tokens: {out.prefill_tokens_per_second:.1f} tokens/s | "
            f"decode {len(out.token_ids)} tokens: {out.decode_tokens_per_second:.1f} tokens/s; "
            "the first run of a configuration includes compiling it]"
        )
        return 0
    outs = llm.generate(ids, params, progress=not args.json)
    for i, out in enumerate(outs):
        if args.json:
            print(json.dumps(_as_json(i, out)), flush=True)
        else:
            print(f"[{i}] {out.text}")
    return 0


def _as_json(index: int, out) -> dict:
    return {
        "index": index,
        "text": out.text,
        "token_ids": out.token_ids,
        "prompt_tokens": len(out.prompt_token_ids),
        "finish_reason": out.finish_reason,
        "prefill_seconds": round(out.prefill_seconds, 4),
        "prefill_tokens_per_second": round(out.prefill_tokens_per_second, 1),
        "decode_seconds": round(out.decode_seconds, 4),
        "decode_tokens_per_second": round(out.decode_tokens_per_second, 1),
        "prefill_density": out.prefill_density,
        "num_cached_tokens": out.num_cached_tokens,
    }


if __name__ == "__main__":
    sys.exit(main())
