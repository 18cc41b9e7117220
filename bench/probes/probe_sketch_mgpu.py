"""The Hopper sketch-scoring kernel (pallas_kernels/mgpu_sketch.py) on the GPU: against float64 NumPy, then against the
Triton kernel and the time XLA takes to read the same bytes.

Checks (the engine's own packing, `sketch.pack_codes`: int4 bytes for Triton, words for Hopper): groups of 4 and 8
query heads, a sketch allocated for more pages than are scored (the kernel reads in place; the pages past num_pages
hold other codes), a ragged last block of pages. Timing: Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim 128), page 16, int4, 30 sparse layers each
with its own random sketch, at 32K, 128K and 256K tokens, 30 layers in one program as bench_sparse.py times the
scoring, medians (min, max) of 20 calls after a warm-up, each waited for, in two alternated rounds: the Triton kernel
at its default launch, the Hopper kernel (what `sketch_page_lse` picks on Hopper), and an XLA sum over the same codes
and scales (the bytes' read time in this harness, which includes a call's dispatch). Then each of the three with the 30
layers repeated 4 times in one program (another q each pass; XLA's reads chained, each pass's sums xor-ed into the
next, or it would read the bytes once for all passes), so that (t4 - t1) / 3 is a token's scoring on the GPU without
the call's dispatch. Writes probe_sketch_mgpu.json under $OUT.

    python bench/probes/probe_sketch_mgpu.py
"""
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
import common  # noqa: E402
from common import call_seconds, run_metadata, stats  # noqa: E402
from jax_offload.sparse import sketch  # noqa: E402
from pallas_kernels import mgpu_sketch  # noqa: E402
from pallas_kernels.sketch import default_launch, runs_on_hopper_kernel  # noqa: E402

HKV, G, D, PAGE, LAYERS = 8, 4, 128, 16, 30
CONTEXTS = (32768, 131072, 262144)
REPEATS = 4


def timed(fn, reps=20):
    s = stats([t * 1e3 for t in call_seconds(fn, reps)])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def check(group: int, seed: int) -> dict:
    """Max |kernel - float64| / max |float64| for 8K tokens less 3 pages in a sketch of 768 pages."""
    rng = np.random.default_rng(seed)
    t = 8192 - 3 * PAGE
    codes, scale = sketch.quantize_keys(jnp.asarray(rng.standard_normal((HKV, t, D)) * 3, jnp.float32), "int4")
    extra = 768 - t // PAGE
    padded = {}  # int4 bytes for the Triton kernel, words for the Hopper one
    for words in (False, True):
        stored = sketch.to_page_layout(sketch.pack_codes(codes, "int4", words), PAGE)
        padded[words] = (jnp.pad(stored, ((0, 0), (0, 0), (0, extra), (0, 0)), constant_values=0x5A),
                         jnp.pad(sketch.to_page_layout(scale, PAGE), ((0, 0), (0, 0), (0, extra)), constant_values=7.0))
    q = jnp.asarray(rng.standard_normal((HKV, group, D)), jnp.bfloat16)
    s64 = (np.einsum("hgd,htd->hgt", np.asarray(q, np.float64), np.asarray(codes, np.float64))
           * np.asarray(scale, np.float64)[:, None] / math.sqrt(D)).reshape(HKV, group, t // PAGE, PAGE)
    m = s64.max(-1)
    ref = m + np.log(np.exp(s64 - m[..., None]).sum(-1))
    num_pages = t // PAGE
    routed = runs_on_hopper_kernel(padded[True][0], bits=4) and mgpu_sketch.is_supported(q, padded[True][0])
    got = pallas_kernels.sketch_page_lse(q, *padded[True], bits=4, num_pages=num_pages)
    block_p, splits = default_launch(num_pages, HKV, PAGE)
    triton = pallas_kernels.sketch_page_lse(q, *padded[False], bits=4, num_pages=num_pages, block_p=block_p,
                                            splits=splits)

    def err(x):
        return float(np.max(np.abs(np.asarray(x, np.float64) - ref)) / np.max(np.abs(ref)))

    return {"seed": seed, "group": group, "routed_to_hopper": routed, "hopper_rel_err": err(got),
            "triton_rel_err": err(triton), "ok": routed and err(got) < 1e-6 and err(triton) < 1e-6}


def _read(c, s, salt):
    """A sum over every byte of a layer's codes and scales (None: codes only), xor-ed with the previous sum: each pass
    depends on the one before, so XLA cannot merge the passes' reads into one."""
    words = jax.lax.bitcast_convert_type(c.reshape(*c.shape[:-1], D // 8, 4), jnp.uint32)
    total = jnp.sum(words ^ salt)
    return total if s is None else total + jnp.sum(jax.lax.bitcast_convert_type(s, jnp.uint32) ^ salt)


def xla_chained_reads(codes, scales, passes: int):
    """XLA reading every layer's sketch bytes `passes` times over, each pass chained to the one before (the floor the
    kernels' GPU time per pass is set against). scales None: the codes alone."""
    sums = [jnp.uint32(0)]
    for _ in range(passes):
        for i in range(len(codes)):
            sums.append(_read(codes[i], None if scales is None else scales[i], sums[-1]))
    return sums[1:]


def gpu_ms_per_pass(runs: dict, names, args, rounds: int) -> dict:
    """Per name, in alternated rounds: (t_REPEATS - t_1) / (REPEATS - 1) in ms, the medians of 20 waited calls of
    runs[name, 1] and runs[name, REPEATS] (programs running their 30 layers once and REPEATS times): one pass's GPU time
    without the call's dispatch."""
    per_pass = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            once, repeated = (lambda n=n, r=r: runs[n, r](*args) for r in (1, REPEATS))
            per_pass[n].append(common.gpu_ms_per_pass(once, repeated, REPEATS, 20))
        print(json.dumps(per_pass), flush=True)
    return per_pass


def main():
    checks = [check(4, 11), check(8, 12)]
    result = {**run_metadata(), "kv_heads": HKV, "group": G, "head_dim": D, "page": PAGE, "layers": LAYERS,
              "checks_vs_float64": checks, "contexts": {}}
    print(json.dumps(checks), flush=True)
    path = Path(os.environ.get("OUT", "."), "probe_sketch_mgpu.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    q = jax.random.normal(jax.random.PRNGKey(1), (LAYERS, HKV, G, D), jnp.bfloat16)
    for tokens in CONTEXTS:
        keys = jax.random.split(jax.random.PRNGKey(tokens), 2 * LAYERS)
        pages = tokens // PAGE
        codes = [jax.random.bits(k, (HKV, PAGE, pages, D // 2), jnp.uint8) for k in keys[:LAYERS]]
        scales = [jax.random.uniform(k, (HKV, PAGE, pages), jnp.float32, 0.01, 0.05) for k in keys[LAYERS:]]
        block_p, splits = default_launch(pages, HKV, PAGE)
        layer_fns = {
            "triton": lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4, block_p=block_p, splits=splits),
            "hopper": lambda q, c, s: pallas_kernels.sketch_page_lse(q, c, s, bits=4),
        }
        runs = {}
        for name, f in layer_fns.items():
            for r in (1, REPEATS):  # r passes over the 30 layers, each with its own q (nothing to deduplicate)
                runs[name, r] = jax.jit(lambda q, c, s, f=f, r=r: [
                    f(q[i] + jnp.bfloat16(j), c[i], s[i]) for j in range(r) for i in range(LAYERS)])

        for r in (1, REPEATS):
            runs["xla_read_of_the_bytes", r] = jax.jit(lambda q, c, s, r=r: xla_chained_reads(c, s, r))
        words = [jax.lax.bitcast_convert_type(c.reshape(*c.shape[:-1], D // 8, 4), jnp.uint32) for c in codes]
        inputs = {name: (words if name == "hopper" else codes, scales) for name, _ in runs}  # the same bytes
        rows = {f"{name}_x{r}": [] for name, r in runs}
        for _ in range(2):  # alternated rounds
            for (name, r), fn in runs.items():
                rows[f"{name}_x{r}"].append(timed(lambda fn=fn, name=name: fn(q, *inputs[name])))
                print(tokens, name, r, json.dumps(rows[f"{name}_x{r}"][-1]), flush=True)
        per_token = {name: [(b["median_ms"] - a["median_ms"]) / (REPEATS - 1)
                            for a, b in zip(rows[f"{name}_x1"], rows[f"{name}_x{REPEATS}"])]
                     for name in (*layer_fns, "xla_read_of_the_bytes")}
        print(tokens, "gpu ms per pass", json.dumps(per_token), flush=True)
        nbytes = sum(c.nbytes + s.nbytes for c, s in zip(codes, scales))
        result["contexts"][str(tokens)] = {
            "sketch_bytes_30_layers": nbytes, "x30": rows, "gpu_ms_per_pass_of_30_layers": per_token}
        path.write_text(json.dumps(result, indent=1) + "\n")
        del codes, scales, words, inputs


if __name__ == "__main__":
    main()
