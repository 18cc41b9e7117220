"""Sparse attention policies: which keys attention reads. A policy decides *what* to read; the KV store and
the ring decide *how* it moves.

Decode policies (`LLM(decode_policy=...)`, offloaded KV): "full" reads every block; "sketch" (`sketch.py`) reads,
per KV head, the pages of most estimated attention mass, scored from a low-bit copy of the keys in GPU memory;
"quest" (`quest.py`) the pages with the highest Quest bounds. Both page policies give the decode step a static
scorer and their metadata per layer (`scorer.page_scores`, `metadata(layer)`); the rest of the step is shared.
"""
