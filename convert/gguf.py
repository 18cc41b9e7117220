"""Dequantize a GGUF checkpoint into a plain Hugging Face directory (float32 safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def _check_gguf(gguf_path: Path) -> None:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist.")
    with gguf_path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{gguf_path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r}).")


def _mirror_rope_theta(config_path: Path) -> None:
    # transformers 5 writes rope_theta only inside rope_parameters; transformers 4.x and plain
    # JSON readers look for it at the top level and would silently fall back to 10000.
    config = json.loads(config_path.read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files to out_dir.

    Returns out_dir. The GGUF must hold an architecture that transformers can load from GGUF.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    _check_gguf(gguf_path)

    # Heavy imports stay local so importing this module is cheap.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)

    state = model.state_dict()
    # Tied lm_head shares storage with the embedding; safetensors refuses shared tensors and
    # transformers re-ties it on load.
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = model.config
    # The weights are no longer quantized; a leftover gguf quantization_config would make
    # from_pretrained look for the .gguf file again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    _mirror_rope_theta(out_dir / "config.json")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
