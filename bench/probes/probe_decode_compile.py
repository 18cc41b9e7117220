"""Probe: compile and run time of one in-GPU decode layer step (`decode_layer_in_device`) as the KV cache grows,
8B shape, bf16. `decode_state` unrolls one merge per 256-key split, so a cache of max_model_len keys unrolls
max_model_len / 256 merges: does the step still compile in reasonable time at 128K? Prints JSON lines; writes
probe_decode_compile.json under $OUT when set."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import model_config, random_params  # noqa: E402

from jax_offload.attention import decode_layer_in_device, default_attention_impl  # noqa: E402
from jax_offload.models.rope import inverse_frequencies  # noqa: E402

gpu = jax.default_backend() == "gpu"
cfg = model_config("llama-3.1-8b" if gpu else "smoke", 1)
params = random_params(cfg, jnp.bfloat16)
inv_freq = jnp.asarray(inverse_frequencies(cfg.rope, cfg.head_dim))
impl = default_attention_impl()
x = jnp.ones((1, 1, cfg.hidden_size), jnp.bfloat16)
rows = []
for length in ([8192, 32768, 131072] if gpu else [1024, 4096]):
    k = jnp.zeros((1, length, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    v = jnp.zeros_like(k)
    t = time.perf_counter()
    out = decode_layer_in_device(cfg, impl, params.layers[0], x, inv_freq, k, v, jnp.int32(length // 2))
    jax.block_until_ready(out)
    first = time.perf_counter() - t
    _, k, v = out
    ts = []
    for i in range(10):
        t = time.perf_counter()
        out = decode_layer_in_device(cfg, impl, params.layers[0], x, inv_freq, k, v, jnp.int32(length // 2 + i))
        jax.block_until_ready(out)
        _, k, v = out
        ts.append(time.perf_counter() - t)
    rows.append({"max_len": length, "first_call_s": first, "step_ms_median": float(np.median(ts) * 1e3),
                 "device": jax.devices()[0].device_kind, "jax": jax.__version__})
    print(json.dumps(rows[-1]), flush=True)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_decode_compile.json").write_text(json.dumps(rows, indent=1))
