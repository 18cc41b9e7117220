"""Where the offloaded KV cache lives: the pinned-host block store and the GPU ring it streams through."""
