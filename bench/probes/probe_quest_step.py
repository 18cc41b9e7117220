"""Probe: where one Quest decode layer's GPU time goes (8B shape, 128K context, budget 4096, page 16).

Times, per call (median of 30 after warm-up, each call waited for): the page choice as written
(elementwise bound, top_k over every page slot), its parts, a bound from two matmuls
(q+ . kmax + q- . kmin), and the layer steps quest_begin / decode_begin / decode_end (its H100 result also timed
quest_end, attention over pages already gathered, since replaced by quest_read: see probe_quest_layer.py).
Prints JSON; writes probe_quest_step.json under $OUT when set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import call_seconds, model_config, random_params  # noqa: E402

from jax_offload.attention import decode_begin, decode_end, quest_begin  # noqa: E402
from jax_offload.models.rope import inverse_frequencies  # noqa: E402
from jax_offload.sparse import quest  # noqa: E402

gpu = jax.default_backend() == "gpu"
cfg = model_config("llama-3.1-8b" if gpu else "smoke", 1)
params = random_params(cfg, jnp.bfloat16)
layer = params.layers[0]
inv_freq = jnp.asarray(inverse_frequencies(cfg.rope, cfg.head_dim))
HKV, D, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
BS, PAGE, BUDGET = (4096, 16, 4096) if gpu else (256, 16, 256)
CTX = 131072 if gpu else 2048
SLOTS = 66 * BS // PAGE if gpu else 4 * CTX // PAGE
NUM_PAGES = CTX // PAGE
k_pages = BUDGET // PAGE
rng = np.random.default_rng(0)
kmin = jnp.asarray(rng.standard_normal((HKV, SLOTS, D)), jnp.bfloat16)
kmax = kmin + jnp.asarray(np.abs(rng.standard_normal((HKV, SLOTS, D))), jnp.bfloat16)
q = jnp.asarray(rng.standard_normal((cfg.num_heads, D)), jnp.bfloat16)
out: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "slots": SLOTS, "pages": NUM_PAGES}


def med(name, f, reps=30):
    ts = [t * 1e3 for t in call_seconds(f, reps)]
    out[name] = {"median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts))}
    print(name, out[name], flush=True)


num_pages = jnp.int32(NUM_PAGES)
select = jax.jit(quest.select_pages, static_argnums=(4,))
med("select_pages", lambda: select(q, kmin, kmax, num_pages, k_pages))


@jax.jit
def bound_elementwise(q, kmin, kmax):
    qf = q.astype(jnp.float32).reshape(HKV, -1, 1, D)
    b = jnp.sum(jnp.maximum(qf * kmin[:, None].astype(jnp.float32), qf * kmax[:, None].astype(jnp.float32)), -1)
    return jnp.max(b, axis=1)


@jax.jit
def bound_matmul(q, kmin, kmax):
    qf = q.astype(jnp.float32).reshape(HKV, -1, D)
    hi = jnp.einsum("hgd,hpd->hgp", jnp.maximum(qf, 0), kmax.astype(jnp.float32), precision="highest")
    lo = jnp.einsum("hgd,hpd->hgp", jnp.minimum(qf, 0), kmin.astype(jnp.float32), precision="highest")
    return jnp.max(hi + lo, axis=1)


b = bound_elementwise(q, kmin, kmax)
out["bound_max_abs_diff"] = float(jnp.max(jnp.abs(b - bound_matmul(q, kmin, kmax))))
med("bound_elementwise", lambda: bound_elementwise(q, kmin, kmax))
med("bound_matmul", lambda: bound_matmul(q, kmin, kmax))
top_k = jax.jit(lambda x: jax.lax.top_k(x, k_pages))
med("top_k", lambda: top_k(b))
sort_desc = jax.jit(lambda x: jnp.argsort(-x, axis=-1)[:, :k_pages])
med("argsort", lambda: sort_desc(b))

tail = jnp.asarray(rng.standard_normal((2, BS, HKV, D)), jnp.bfloat16)
x = jnp.asarray(rng.standard_normal((1, 1, cfg.hidden_size)), jnp.bfloat16)
pos, tail_len = jnp.int32(CTX + 5), jnp.int32(5)
med("quest_begin", lambda: quest_begin(cfg, layer, x, inv_freq, jnp.copy(tail), pos, tail_len, (kmin, kmax), k_pages,
                                       PAGE, BS, num_pages))
med("tail_copy_only", lambda: jnp.copy(tail))
impl = "pallas" if gpu else "xla"
med("decode_begin", lambda: decode_begin(cfg, layer, x, inv_freq, jnp.copy(tail), pos, tail_len))
qd, td, sd = decode_begin(cfg, layer, x, inv_freq, jnp.copy(tail), pos, tail_len)
med("decode_end", lambda: decode_end(cfg, impl, layer, x, qd, td, tail_len, sd))
print(json.dumps(out))
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "probe_quest_step.json").write_text(json.dumps(out, indent=1))
