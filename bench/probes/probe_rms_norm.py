"""RMSNorm's fixed-order row sum on the GPU: the halving tree as one XLA fusion chain against the tree cut at 64
columns (`jax_offload.models.decoder._sum_last_axis`), bf16 rows of 4096 (Llama-3.1-8B's hidden size).

Per row count: bitwise equality of the two, and ms of a jitted RMSNorm (median, min, max of 20 calls after a
warm-up). Writes probe_rms_norm.json under --out.

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

HIDDEN, EPS = 4096, 1e-5
ROWS = (1, 64, 1024, 4096, 16384)


def uncut_sum(x):
    """The tree as it was before the cut: every level fused as XLA likes."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm_with(sum_fn):
    def f(x, w):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(sum_fn(x32 * x32) / x.shape[-1] + EPS)
        return w * normed.astype(x.dtype)
    return jax.jit(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    old, new = rms_norm_with(uncut_sum), rms_norm_with(decoder._sum_last_axis)
    result = {"meta": run_metadata(), "hidden": HIDDEN, "rows": {}}
    w = jax.random.normal(jax.random.key(1), (HIDDEN,), jnp.bfloat16)
    for rows in ROWS:
        x = jax.random.normal(jax.random.key(rows), (rows, HIDDEN), jnp.bfloat16) * 3
        same = bool(np.array_equal(np.asarray(old(x, w)), np.asarray(new(x, w))))
        row = {"bitwise_equal": same}
        for name, fn in (("uncut", old), ("cut", new)):
            row[name + "_ms"] = stats([t * 1e3 for t in call_seconds(lambda: fn(x, w), 20)])
        result["rows"][str(rows)] = row
        print(rows, json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_rms_norm.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
