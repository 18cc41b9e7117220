"""Checkpoint conversion: Hugging Face safetensors -> parameter pytrees; GGUF -> safetensors."""
