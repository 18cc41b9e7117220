"""RMSNorm's fixed-order row sum on the GPU: the halving tree as XLA fuses it against the tree cut at 64 columns
(`jax_offload.models.decoder._sum_last_axis` with the cut at any row count), bf16 rows of 1024 and 4096 (Qwen3-0.6B's
and Llama-3.1-8B's hidden sizes), for the row count from which the engine should cut.

Per shape: bitwise equality of the two, and us per RMSNorm in a program of 64 chained ones (as a model's layers
run them; median, min, max of 20 calls after a warm-up). Writes probe_rms_norm.json under --out.

    python bench/probes/probe_rms_norm.py --out $OUT
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.models import decoder  # noqa: E402

EPS = 1e-5
SHAPES = [(rows, hidden) for hidden in (1024, 4096) for rows in (1, 16, 64, 256, 1024, 4096)] + [(16384, 4096)]
CHAIN = 64


def uncut_sum(x):
    """The tree as it was before the cut: every level fused as XLA likes."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm_with(sum_fn):
    def norm(x, w):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(sum_fn(x32 * x32) / x.shape[-1] + EPS)
        return w * normed.astype(x.dtype)

    def chain(x, w):
        for _ in range(CHAIN):
            x = norm(x, w) + x
        return x
    return jax.jit(norm), jax.jit(chain)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    decoder._TREE_CUT_MIN_ROWS = 1
    (old, old_chain), (new, new_chain) = rms_norm_with(uncut_sum), rms_norm_with(decoder._sum_last_axis)
    result = {"meta": run_metadata(), "chain": CHAIN, "shapes": {}}
    for rows, hidden in SHAPES:
        w = jax.random.normal(jax.random.key(1), (hidden,), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(rows), (rows, hidden), jnp.bfloat16) * 3
        row = {"bitwise_equal": bool(np.array_equal(np.asarray(old(x, w)), np.asarray(new(x, w))))}
        for name, fn in (("uncut", old_chain), ("cut", new_chain)):
            row[name + "_us_per_norm"] = stats([t * 1e6 / CHAIN for t in call_seconds(lambda: fn(x, w), 20)])
        result["shapes"][f"{rows}x{hidden}"] = row
        print(rows, hidden, row["bitwise_equal"], round(row["uncut_us_per_norm"]["median"], 2),
              round(row["cut_us_per_norm"]["median"], 2), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_rms_norm.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
