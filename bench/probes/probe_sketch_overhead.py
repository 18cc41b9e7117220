"""Where sketch scoring's GPU time goes beyond the Hopper kernel (issue 24, 256K <= 2 ms): the engine's page scores
(kernel + the softmax over pages, `SketchScore.page_scores`) against the kernel alone and against the softmax's
normalizer taken in one pass (a variadic reduce of (max, sum)); the optimized HLO of one layer's scoring. Llama-3.1-8B
shape, 30 sparse layers, page 16, int4 words, random codes; GPU ms of one pass over 30 layers, median (min-max) of 5
alternated rounds."""
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import gpu_ms_per_pass, stats  # noqa: E402

import pallas_kernels  # noqa: E402
from jax_offload.sparse.sketch import SketchScore, mass_of_pages  # noqa: E402

HKV, G, D, PAGE, LAYERS, PASSES = 8, 4, 128, 16, 30, 4
out = Path(os.environ.get("OUT", "/tmp")) / "probe_sketch_overhead"
out.mkdir(parents=True, exist_ok=True)


def mass_one_pass(lse, num_pages):
    visible = jnp.arange(lse.shape[-1]) < num_pages
    s = jnp.where(visible, lse, -jnp.inf)

    def combine(a, b):
        (ma, la), (mb, lb) = a, b
        m = jnp.maximum(ma, mb)
        safe = jnp.where(jnp.isfinite(m), m, 0.0)
        return m, la * jnp.exp(ma - safe) + lb * jnp.exp(mb - safe)

    m, l = lax.reduce((s, visible.astype(jnp.float32) * jnp.ones_like(s)), (np.float32(-np.inf), np.float32(0)),
                      combine, (2,))
    log_z = jnp.where(l > 0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.maximum(l, 1e-30)), 0.0)
    return jnp.where(visible, jnp.exp(s - log_z[..., None]), 0.0).sum(axis=1)


def variants(num_pages):
    scorer = SketchScore("int4", PAGE)
    return {
        "engine": lambda q, meta, n: scorer.page_scores("pallas", q, meta, n, num_pages),
        "kernel": lambda q, meta, n: pallas_kernels.sketch_page_lse(q.reshape(HKV, G, D), *meta, bits=4,
                                                                    num_pages=num_pages),
        "one_pass": lambda q, meta, n: mass_one_pass(pallas_kernels.sketch_page_lse(
            q.reshape(HKV, G, D), *meta, bits=4, num_pages=num_pages), n),
    }


def main():
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    rng = np.random.default_rng(0)
    for ctx in (131072, 262144):
        p = ctx // PAGE
        metas = [(jax.device_put(rng.integers(0, 2**32, (HKV, PAGE, p, D // 8), dtype=np.uint32)),
                  jax.device_put(rng.uniform(0.01, 0.05, (HKV, PAGE, p)).astype(np.float32))) for _ in range(LAYERS)]
        q = jax.random.normal(jax.random.PRNGKey(1), (HKV * G, D), jnp.bfloat16)
        n = jax.device_put(np.int32(p - 3))
        fns = variants(p)
        # Agreement of the one-pass normalizer with the engine's.
        a, b = (jax.jit(fns[k])(q, metas[0], n) for k in ("engine", "one_pass"))
        result[f"one_pass_max_abs_diff_{ctx}"] = float(jnp.max(jnp.abs(a - b)))
        if ctx == 262144:
            (out / "engine_one_layer.hlo.txt").write_text(jax.jit(fns["engine"]).lower(q, metas[0], n).compile().as_text())

        def program(fn, passes):
            return jax.jit(lambda q, metas, n: [fn(q + jnp.bfloat16(j), m, n) for j in range(passes) for m in metas])

        progs = {k: (program(f, 1), program(f, PASSES)) for k, f in fns.items()}
        rounds = {k: [] for k in fns}
        for _ in range(5):
            for k, (once, rep) in progs.items():
                rounds[k].append(gpu_ms_per_pass(lambda: once(q, metas, n), lambda: rep(q, metas, n), PASSES, 20))
        result[str(ctx)] = {k: stats(v) for k, v in rounds.items()}
        print(ctx, json.dumps(result[str(ctx)]), flush=True)
        del metas
    (out / "probe_sketch_overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
