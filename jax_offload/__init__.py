"""jax_offload: long-context LLM inference in JAX with the KV cache in pinned host memory."""
from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Segments"]

if TYPE_CHECKING:
    from jax_offload.engine import LLM
    from jax_offload.outputs import RequestOutput
    from jax_offload.blend import Segments
    from jax_offload.sampling import SamplingParams


def __getattr__(name: str):
    # Lazy so that `import jax_offload.config` (used by `convert`) does not pull in the engine.
    if name in ("LLM", "RequestOutput"):
        from jax_offload import engine

        return getattr(engine, name)
    if name == "Segments":
        from jax_offload.blend import Segments

        return Segments
    if name == "SamplingParams":
        from jax_offload.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jax_offload' has no attribute {name!r}")
