"""Continuous batching: many requests decode together over a paged KV pool (nano-vllm's shape, in JAX)."""
