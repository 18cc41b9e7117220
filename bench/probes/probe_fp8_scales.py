"""Which scale granularity for the fp8 KV cache, on the real default model (SmolLM2-135M-Instruct, float32 on the
CPU): the logits of NIAH prompts with K and V rounded through float8_e4m3fn under each scheme, against the
unrounded cache ("auto"). Schemes (each in its own process, since the engine's compiled steps are cached):

  token_pow2   the engine's: a power-of-two scale per token, KV head and K|V (max |x| into [224, 448])
  token_exact  a float32 scale per token, KV head and K|V: max |x| / 448 exactly
  tensor_unit  no scale (scale 1, vLLM's default without calibrated scales), values clipped to +-448
  key_channel  keys: a power-of-two scale per KV head and channel over the prompt (KIVI's grouping for keys, one
               scale per channel for the whole sequence); values per token as token_pow2

    python bench/probes/probe_fp8_scales.py --out bench/probes/probe_fp8_scales.cpu.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMES = ("token_pow2", "token_exact", "tensor_unit", "key_channel")


def _patch(scheme: str) -> None:
    """Makes the engine's K/V rounding follow `scheme` (a probe only: the store's own encode is not used here,
    every run stays in GPU memory, where only the rounding decides the numbers)."""
    import jax.numpy as jnp

    from jax_offload.kv import kv_cache_dtype as kvd
    from jax_offload.models import decoder

    def fp8(x):
        return x.astype(jnp.float8_e4m3fn).astype(jnp.float32)

    def token_exact(x):
        x32 = x.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-30) / kvd.FP8_MAX
        return (fp8(x32 / scale) * scale).astype(x.dtype)

    def tensor_unit(x):
        return fp8(jnp.clip(x.astype(jnp.float32), -kvd.FP8_MAX, kvd.FP8_MAX)).astype(x.dtype)

    calls = {"n": 0}

    def key_channel(x):
        # decoder.attention_inputs rounds k first, then v, in every layer step.
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            return kvd.dequantize(kvd.quantize_fp8(x), x.dtype)
        # x [B, T, Hkv, D]: one scale per (KV head, channel) over the whole prompt chunk.
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
        mantissa, exponent = jnp.frexp(amax)
        exponent = exponent - 9 + (mantissa > kvd.FP8_MAX / 512).astype(exponent.dtype)
        scale = jnp.ldexp(jnp.ones_like(amax), jnp.clip(exponent, -126, 127))
        return (fp8(x.astype(jnp.float32) / scale) * scale).astype(x.dtype)

    rounding = {"token_exact": token_exact, "tensor_unit": tensor_unit, "key_channel": key_channel}.get(scheme)
    if rounding is not None:
        decoder.round_trip = lambda kv_cache_dtype, x: x if kv_cache_dtype == "auto" else rounding(x)


def run_scheme(scheme: str, lengths: list[int], samples: int, last: int) -> dict:
    import numpy as np

    from eval_sparse import build_prompts
    from jax_offload import LLM
    from jax_offload.default_model import ensure_default_model

    _patch(scheme)
    model = ensure_default_model(quiet=True)
    prompts = build_prompts(model, {n: n - 32 for n in lengths}, samples, 42)
    auto = LLM(model, dtype="float32", max_model_len=max(lengths))
    fp8 = LLM(model, dtype="float32", max_model_len=max(lengths), kv_cache_dtype="fp8")
    rows = []
    for n, items in prompts.items():
        d_max, d_mean, top1 = [], [], []
        for s in items:
            a, b = auto.logits(s.prompt_ids, last=last), fp8.logits(s.prompt_ids, last=last)
            d = np.abs(b - a)
            d_max.append(float(d.max()))
            d_mean.append(float(d.mean()))
            top1.append(float(np.mean(a.argmax(-1) == b.argmax(-1))))
        rows.append({"length": n, "prompts": len(items), "max_abs_diff": max(d_max),
                     "mean_abs_diff": float(np.mean(d_mean)), "top1_agreement": float(np.mean(top1))})
    return {"scheme": scheme, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--samples", type=int, default=1, help="prompts per NIAH task (8 tasks)")
    p.add_argument("--last", type=int, default=64)
    p.add_argument("--scheme", choices=SCHEMES, help="run one scheme in this process (internal)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.scheme:
        print(json.dumps(run_scheme(a.scheme, lengths, a.samples, a.last)))
        return
    from common import run_metadata

    results = []
    for scheme in SCHEMES:
        out = subprocess.run([sys.executable, __file__, "--scheme", scheme, "--lengths", a.lengths, "--samples",
                              str(a.samples), "--last", str(a.last)], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    a.out.write_text(json.dumps({**run_metadata(), "model": "SmolLM2-135M-Instruct", "dtype": "float32",
                                 "last_positions": a.last, "results": results}, indent=1))


if __name__ == "__main__":
    main()
