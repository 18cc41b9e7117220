"""Where a sketch decode step's page choice goes past the scoring kernel, on the GPU: each layer's softmax over its
pages (`sketch.mass_of_pages`) and the top-k of `quest.top_pages`, as the engine had them and as it has them now.

Before: one `jax.lax.top_k` over the row of pages (which XLA's GPU backend compiles to a sort of the whole row). Now:
`quest.top_k` in stages of TOP_K_CHUNK pages. Also a candidate not adopted: the page softmax's max and sum of
exponentials in one variadic reduction (`mass_one_pass`) instead of the engine's two. Programs of 30 sparse layers
(Llama-3.1-8B shape, 8 KV heads of 4 query heads, page 16, int4 sketch, random codes, budget 256 pages), GPU ms per
pass as probe_sketch_mgpu.py measures it ((t4 - t1) / 3, medians of 20 waited calls), 5 alternated rounds, at 32K,
128K and 256K tokens:
  kernel                 the Hopper kernel's page log-sum-exps alone
  mass / mass_one_pass   + the softmax over pages, the engine's / the candidate
  top_k_before           a top-256 of random page masses, one top-k over the row (the kernel and mass not run)
  top_k_chunk_C          the same in stages of C pages (C = 1024, 2048, 4096; the engine's TOP_K_CHUNK is one)
  choice_before / choice kernel + mass + top_pages, before / now
Also: the masses against float64 and the pages each choice picks (before == now). Writes probe_sketch_choice.json
under $OUT.

    python bench/probes/probe_sketch_choice.py
"""
import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from common import run_metadata  # noqa: E402
from jax_offload.sparse import quest, sketch  # noqa: E402
from probe_sketch_mgpu import REPEATS, gpu_ms_per_pass  # noqa: E402

HKV, G, D, PAGE, LAYERS, BUDGET_PAGES = 8, 4, 128, 16, 30, 256
CONTEXTS = (32768, 131072, 262144)
CHUNKS = (1024, 2048, 4096)
ROUNDS = 5


def mass_one_pass(lse: jax.Array, num_pages: jax.Array) -> jax.Array:
    """`sketch.mass_of_pages` with each head's max and sum of exponentials from one reduction of (max, sum) pairs."""
    visible = jnp.arange(lse.shape[-1]) < num_pages
    s = jnp.where(visible, lse, -jnp.inf)

    def finite(m):
        return jnp.where(m == -jnp.inf, 0.0, m)

    def combine(a, b):
        (ma, la), (mb, lb) = a, b
        m = jnp.maximum(ma, mb)
        return m, la * jnp.exp(ma - finite(m)) + lb * jnp.exp(mb - finite(m))

    m, total = jax.lax.reduce((s, jnp.ones_like(s)), (jnp.float32(-jnp.inf), jnp.float32(0.0)), combine, (2,))
    e = jnp.where(visible, jnp.exp(s - finite(m)[..., None]), 0.0)
    return (e / jnp.maximum(total, 1e-30)[..., None]).sum(axis=1)


@contextlib.contextmanager
def top_k_chunk(chunk: int):
    """quest.top_k's stage length while a program is traced (a chunk of at least the row: one top-k, as before)."""
    saved, quest.TOP_K_CHUNK = quest.TOP_K_CHUNK, chunk
    try:
        yield
    finally:
        quest.TOP_K_CHUNK = saved


def float64_mass(lse: np.ndarray, num_pages: int) -> np.ndarray:
    s = lse[..., :num_pages].astype(np.float64)
    e = np.exp(s - s.max(-1, keepdims=True))
    out = np.zeros(lse.shape[::2])
    out[:, :num_pages] = (e / e.sum(-1, keepdims=True)).sum(1)
    return out


def main():
    result = {**run_metadata(), "kv_heads": HKV, "group": G, "head_dim": D, "page": PAGE, "layers": LAYERS,
              "budget_pages": BUDGET_PAGES, "engine_top_k_chunk": quest.TOP_K_CHUNK, "contexts": {}}
    path = Path(os.environ.get("OUT", "."), "probe_sketch_choice.json")
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    whole_row = 1 << 30
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS + 1)
        pages = tokens // PAGE
        num_pages = jnp.int32(pages - 3)  # the last pages not written yet, as mid-block
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:-1]]
        masses = jax.random.uniform(keys[-1], (LAYERS, HKV, pages), jnp.float32)

        def lse(qi, c, s):
            return pallas_kernels.sketch_page_lse(qi, c, s, bits=4)

        on_sketch = {  # name: (per-layer function of (q, codes, scales), top-k chunk while traced)
            "kernel": (lse, whole_row),
            "mass": (lambda qi, c, s: sketch.mass_of_pages(lse(qi, c, s), num_pages), whole_row),
            "mass_one_pass": (lambda qi, c, s: mass_one_pass(lse(qi, c, s), num_pages), whole_row),
            "choice_before": (lambda qi, c, s: quest.top_pages(sketch.mass_of_pages(lse(qi, c, s), num_pages),
                                                               num_pages, BUDGET_PAGES), whole_row),
            "choice": (lambda qi, c, s: quest.top_pages(sketch.mass_of_pages(lse(qi, c, s), num_pages), num_pages,
                                                        BUDGET_PAGES), quest.TOP_K_CHUNK),
        }
        on_masses = {"top_k_before": whole_row, **{f"top_k_chunk_{c}": c for c in CHUNKS}}
        runs = {}
        for r in (1, REPEATS):  # r passes over the 30 layers, each with its own input (nothing to deduplicate)
            for name, (f, chunk) in on_sketch.items():
                with top_k_chunk(chunk):
                    runs[name, r] = jax.jit(lambda q, c, s, m, f=f, r=r: [
                        f(q[i] + jnp.bfloat16(j), c[i], s[i]) for j in range(r) for i in range(LAYERS)]
                    ).lower(q, codes, scales, masses).compile()
            for name, chunk in on_masses.items():
                with top_k_chunk(chunk):
                    runs[name, r] = jax.jit(lambda q, c, s, m, r=r: [
                        quest.top_pages(m[i] + j, num_pages, BUDGET_PAGES) for j in range(r) for i in range(LAYERS)]
                    ).lower(q, codes, scales, masses).compile()
        args = (q, codes, scales, masses)
        page_lse = np.asarray(runs["kernel", 1](*args)[0], np.float64)
        ref = float64_mass(page_lse, int(num_pages))
        errors = {name: float(np.max(np.abs(np.asarray(runs[name, 1](*args)[0], np.float64) - ref))
                             / np.max(np.abs(ref))) for name in ("mass", "mass_one_pass")}
        def same_pages(x, y):
            return all(np.array_equal(a, b) for a, b in zip(runs[x, 1](*args), runs[y, 1](*args)))

        same_choice = same_pages("choice_before", "choice")
        one_pass_same_pages = all(np.array_equal(quest.top_pages(a, num_pages, BUDGET_PAGES),
                                                 quest.top_pages(b, num_pages, BUDGET_PAGES))
                                  for a, b in zip(runs["mass", 1](*args), runs["mass_one_pass", 1](*args)))
        same_top_k = {name: same_pages("top_k_before", name) for name in on_masses}
        print(tokens, json.dumps(errors), "same pages", same_choice, one_pass_same_pages, json.dumps(same_top_k),
              flush=True)
        per_pass = gpu_ms_per_pass(runs, [*on_sketch, *on_masses], args, rounds=ROUNDS)
        result["contexts"][str(tokens)] = {
            "mass_rel_err_vs_float64_layer0": errors, "choice_same_pages_30_layers": same_choice,
            "one_pass_mass_same_pages_30_layers": one_pass_same_pages,
            "top_k_same_pages_30_layers": same_top_k, "gpu_ms_per_pass_of_30_layers": per_pass}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales, masses


if __name__ == "__main__":
    main()
