"""Which part of the fp8 KV cache costs NIAH accuracy on the real model, and what would win it back: SmolLM2-135M
(bf16), the eight NIAH tasks at one length, 40 prompts each, greedy, in GPU memory, with K and V rounded at
projection as a variant says (the cache itself stays bf16, which holds every variant's values exactly, so
`fp8` here is the engine's fp8 cache bit for bit):

  fp8      per-token power-of-two scale, K and V (the engine's format)
  fp8_k    keys only;  fp8_v   values only
  exact    per-token scale max|x| / 448 (not a power of two), K and V
  sink16   fp8, but the first 16 positions (the attention sink) unrounded
  smooth   fp8, keys less their per-channel mean over the prefill call (SageAttention's key smoothing; added back)
  int8_k   keys int8 with a per-token scale max|x| / 127, values fp8;  int8   K and V int8
  rot_k    fp8, q and k rotated by a randomised Hadamard matrix H S / sqrt(D) first (FlashAttention-3's incoherent
           processing, QuaRot: large channels spread over all D, so e4m3's relative error averages over q.k)
  rot      the same for q, k and v, the attention output rotated back (measured as a build of the engine)
  out2_k, out4_k   fp8, but each key vector's 2 / 4 largest |channels| kept in bf16 and the scale set by the rest
           (KVQuant's dense-and-sparse split: the few channels that carry a logit are not rounded)
  bf16     nothing rounded: the same-process peer

    python bench/probes/probe_fp8_variants.py --model DIR --length 8192 --out $OUT/fp8_variants
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import run_metadata  # noqa: E402
from eval_sparse import build_prompts, prompt_target, run_prompts, task_scores  # noqa: E402

VARIANTS = ("fp8_k", "fp8_v", "sink16", "smooth", "exact", "fp8", "int8_k", "int8", "rot_k", "rot", "out2_k", "out4_k",
            "bf16")


def rounders(variant: str):
    """(round keys, round values): functions of (x [B, T, Hkv, D], positions [B, T])."""
    import jax
    import jax.numpy as jnp

    from jax_offload.kv.kv_cache_dtype import FP8, round_trip

    def pow2(x, positions):
        return round_trip("fp8", x)

    def exact(x, positions):
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / 448.0, 1.0)
        return ((x.astype(jnp.float32) / scale).astype(FP8).astype(jnp.float32) * scale).astype(x.dtype)

    def sink(x, positions):
        return jnp.where((positions < 16)[..., None, None], x, pow2(x, positions))

    def smooth(x, positions):
        mean = jnp.mean(x.astype(jnp.float32), axis=1, keepdims=True)
        return (mean + pow2(x.astype(jnp.float32) - mean, positions).astype(jnp.float32)).astype(x.dtype)

    def int8(x, positions):
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        return (jnp.round(x.astype(jnp.float32) / scale) * scale).astype(x.dtype)

    def keep(x, positions):
        return x

    def outliers(n):
        def split(x, positions):
            size = jnp.abs(x.astype(jnp.float32))
            kept = size >= jax.lax.top_k(size, n)[0][..., -1:]
            return jnp.where(kept, x, pow2(jnp.where(kept, 0, x), positions))
        return split

    return {"fp8": (pow2, pow2), "fp8_k": (pow2, keep), "fp8_v": (keep, pow2), "exact": (exact, exact),
            "sink16": (sink, sink), "smooth": (smooth, pow2), "int8_k": (int8, pow2), "int8": (int8, int8),
            "rot_k": (pow2, pow2), "rot": (pow2, pow2), "out2_k": (outliers(2), pow2),
            "out4_k": (outliers(4), pow2), "bf16": (keep, keep)}[variant]


def hadamard(x):
    """x [..., D] @ H / sqrt(D), H the Sylvester Hadamard matrix (symmetric), by the butterfly; float32."""
    import jax.numpy as jnp

    d = x.shape[-1]
    x = x.astype(jnp.float32)
    h = 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = jnp.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], -2).reshape(
            *x.shape[:-1], d)
        h *= 2
    return x / d**0.5


def signs(d: int):
    """The rotation's fixed random signs S (float32 +-1 [d])."""
    import numpy as np

    return np.where(np.random.default_rng(d).random(d) < 0.5, -1.0, 1.0).astype(np.float32)


def patch_attention_inputs(variant: str) -> None:
    """decoder.attention_inputs with the variant's rounding of K and V (the engine's own rounding off: "auto")."""
    import jax

    from jax_offload.models import decoder

    original = decoder.__dict__.setdefault("_unpatched_attention_inputs", decoder.attention_inputs)
    original_output = decoder.__dict__.setdefault("_unpatched_output", decoder.attention_output_and_mlp)
    round_k, round_v = rounders(variant)
    rotated = {"rot_k": "qk", "rot": "qkv"}.get(variant, "")

    def rotate(x):  # x @ S H / sqrt(D), an orthogonal matrix: q.k is unchanged
        return hadamard(x.astype("float32") * signs(x.shape[-1])).astype(x.dtype)

    def attention_inputs(cfg, layer, x, positions, inv_freq):
        q, k, v = original(cfg, layer, x, positions, inv_freq)
        if rotated:
            q, k = rotate(q), rotate(k)
        if rotated == "qkv":
            v = rotate(v)
        return q, round_k(k, positions), round_v(v, positions)

    def attention_output_and_mlp(cfg, layer, x, attn):
        if rotated == "qkv":  # the transpose, H S / sqrt(D), undoes the rotation of v
            attn = hadamard(attn) * signs(attn.shape[-1])
        return original_output(cfg, layer, x, attn)

    decoder.attention_inputs = attention_inputs
    decoder.attention_output_and_mlp = attention_output_and_mlp
    jax.clear_caches()  # the step functions traced the previous variant


def main() -> None:
    import gc

    from jax_offload import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    base = {"dtype": "bfloat16"}
    target = prompt_target(a.model, base, a.length, 32)
    prompts = build_prompts(a.model, {a.length: target}, a.samples, 42)[a.length]
    for variant in a.variants.split(","):
        patch_attention_inputs(variant)
        llm = LLM(a.model, **base)
        records = run_prompts(llm, prompts, 32, variant)
        scores = task_scores(records)
        result = {"variant": variant, "length": a.length, "scores": scores,
                  "mean_score": sum(scores.values()) / len(scores), "records": records, **run_metadata()}
        (a.out / f"fp8_variant_{a.length}_{variant}.json").write_text(json.dumps(result))
        print(variant, round(result["mean_score"], 2), {t: round(s, 1) for t, s in scores.items()}, flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
