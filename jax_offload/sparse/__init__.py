"""Sparse attention policies: which keys attention reads. A policy decides *what* to read; the KV store and
the ring decide *how* it moves.

Decode policies (`LLM(decode_policy=...)`, offloaded KV): "full" reads every block; "quest" (`quest.py`) reads,
per KV head, the pages with the highest Quest bounds.
"""
