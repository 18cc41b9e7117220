"""Block-selection policies: which host KV blocks a decode step streams back. One registry, by name."""
from __future__ import annotations

from typing import Protocol


class SparsePolicy(Protocol):
    def select(self, layer: int, num_blocks: int) -> list[int]:
        """Indices (ascending) of the host blocks of `layer` the next decode step attends to."""
        ...


class FullPolicy:
    """Every block: exact attention."""

    def select(self, layer: int, num_blocks: int) -> list[int]:
        return list(range(num_blocks))


POLICIES: dict[str, type] = {"full": FullPolicy}


def make_policy(name: str) -> SparsePolicy:
    if name not in POLICIES:
        raise ValueError(f"sparse_policy {name!r} is unknown; valid: {', '.join(POLICIES)}.")
    return POLICIES[name]()
