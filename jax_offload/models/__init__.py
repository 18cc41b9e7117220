"""The decoder (Llama / Qwen2 / Qwen3 as one implementation) and its parameters."""
