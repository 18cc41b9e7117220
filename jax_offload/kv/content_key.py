"""Content keys of token runs: what prefix caching keys its blocks by and CacheBlend its segments by."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def chained_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of tokens after the key `previous`: a block's after the block before it (the tag for the first), a
    CacheBlend segment's after its engine's tag."""
    return hashlib.sha256(previous + np.asarray(tokens, np.int64).tobytes()).digest()
