"""Offline evaluations: RULER-style needle-in-a-haystack prompts and the harness that runs them."""
