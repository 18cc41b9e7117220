"""One decoder for Llama, Qwen2 and Qwen3, as pure functions over the parameter pytree.

A layer is split at attention: `attention_inputs` gives q, k, v (normed, projected, RoPE'd) and
`attention_output_and_mlp` finishes the layer from the attention output. Attention itself lives with
whoever knows where the KV cache is (in GPU memory or streamed from the host), so every engine mode
shares the exact same layer arithmetic.
"""
from __future__ import annotations

import functools
import itertools
import operator

import jax
import jax.numpy as jnp

from jax_offload.config import ModelConfig
from jax_offload.kv.kv_cache_dtype import round_trip
from jax_offload.models.params import LayerParams, ModelParams
from jax_offload.models.rope import apply_rope, cos_sin
from jax_offload.precision import sum_last_axis
from jax_offload.tensor_parallel import AXIS
from pallas_kernels.matmul import matmul


def _split_shard_groups(x: jax.Array, n: int, widths: tuple[int, ...]) -> list[jax.Array]:
    """x [..., n * sum(widths)] laid out as n shard groups [w_0 | w_1 | ...] (`sharded_layout`) -> one array per
    width, [..., n * w_i], its shards in order. Each shard's part stays on its device."""
    cuts = list(itertools.accumulate(widths))[:-1]
    if n == 1:  # plain slices: the very program of a model without tensor parallelism
        return jnp.split(x, cuts, axis=-1)
    parts = jnp.split(x.reshape(*x.shape[:-1], n, sum(widths)), cuts, axis=-1)
    return [p.reshape(*x.shape[:-1], n * w) for p, w in zip(parts, widths)]


def _column_parallel(layer: LayerParams, x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for `wqkv` and `w_gate_up`, whose output columns are split over the devices: by the batch-invariant
    Pallas matmul when asked (each row's bits independent of the others), on each device over its columns."""
    if not layer.batch_invariant:
        return _dot(x, w)
    multiply = functools.partial(matmul, one_pass=layer.k_one_pass)
    if layer.tp is None:
        return multiply(x, w)
    return layer.tp.per_head(multiply, (None, 1), x.ndim - 1)(x, w)


def _row_parallel(layer: LayerParams, x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for `wo` and `w_down`, whose input rows are split over the devices, each multiplying its part of x.
    Batch-invariant under tensor parallelism: each device's float32 product is gathered and the products are added
    in device order, rounded once; an all-reduce may add them in an order that changes with the message's size,
    so with the batch (at 2 devices it is the one commutative addition either way)."""
    if not layer.batch_invariant:
        return _dot(x, w)
    multiply = functools.partial(matmul, one_pass=layer.k_one_pass)
    if layer.tp is None:
        return multiply(x, w)

    def local(x: jax.Array, w: jax.Array) -> jax.Array:
        products = jax.lax.all_gather(multiply(x, w, out_dtype=jnp.float32), AXIS)
        return functools.reduce(operator.add, list(products)).astype(x.dtype)

    return layer.tp.per_head(local, (x.ndim - 1, 0), None)(x, w)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w by XLA; on the CPU, one sequence at a time where x holds one token of each of several sequences (a decode
    step's [B, 1, K], or the [B, K] rows the LM head reads). XLA's CPU backend multiplies one row by a kernel of its
    own and several by YNNPACK's, whose kernels change with the row count, so a token's bits changed with the batch
    it ran in (tiny Llama of width 128 in bf16: 4 of 240 rows of its MLP, batch 8 against 1). One at a time, each
    product has the shape of a request alone. A prompt's tokens ([1, T, K]) stay one product."""
    one_token_each = x.ndim == 2 or (x.ndim == 3 and x.shape[1] == 1)
    if jax.default_backend() == "cpu" and one_token_each and x.shape[0] > 1:
        return jax.lax.map(lambda row: row @ w, x)
    return x @ w


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, rounded back to the input dtype before the weight (as transformers does)."""
    x32 = x.astype(jnp.float32)
    mean_square = sum_last_axis(x32 * x32) / x.shape[-1]
    normed = x32 * jax.lax.rsqrt(mean_square + eps)
    return weight * normed.astype(x.dtype)


def embed(params: ModelParams, token_ids: jax.Array) -> jax.Array:
    """token_ids [B, T] -> hidden [B, T, hidden]."""
    return jnp.take(params.embed, token_ids, axis=0)


def project_qkv(cfg: ModelConfig, layer: LayerParams, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, hidden] -> q [B, T, Hq, D], k and v [B, T, Hkv, D] before RoPE (normed, projected)."""
    b, t, _ = x.shape
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    qkv = _column_parallel(layer, h, layer.wqkv)
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv
    n = layer.num_shards
    nq, nkv, d = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.head_dim  # per shard
    q, k, v = _split_shard_groups(qkv, n, (nq * d, nkv * d, nkv * d))
    q, k, v = q.reshape(b, t, -1, d), k.reshape(b, t, -1, d), v.reshape(b, t, -1, d)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return q, k, v


def stored_kv(layer: LayerParams, k: jax.Array, v: jax.Array, cos: jax.Array, sin: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """Keys before RoPE and values [B, T, Hkv, D] -> as the KV cache holds them (keys rotated by `cos_sin` of
    their positions, both rounded to the cache's format). Keys kept before RoPE (a CacheBlend segment) land at
    any position with the bits a fresh computation gives them there."""
    return round_trip(layer.kv_cache_dtype, apply_rope(k, cos, sin)), round_trip(layer.kv_cache_dtype, v)


def place_qkv(layer: LayerParams, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
              inv_freq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`project_qkv`'s q, k, v of tokens at `positions` [B, T] -> q rotated, k and v as the KV cache holds them."""
    cos, sin = cos_sin(inv_freq, positions, q.dtype)
    return apply_rope(q, cos, sin), *stored_kv(layer, k, v, cos, sin)


def attention_inputs(
    cfg: ModelConfig, layer: LayerParams, x: jax.Array, positions: jax.Array, inv_freq: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, hidden], positions [B, T] -> q [B, T, Hq, D], k and v [B, T, Hkv, D] (as the KV cache will hold
    them)."""
    return place_qkv(layer, *project_qkv(cfg, layer, x), positions, inv_freq)


def attention_output_and_mlp(cfg: ModelConfig, layer: LayerParams, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Finishes a layer: x [B, T, hidden] residual, attn [B, T, Hq, D] attention output."""
    b, t, _ = x.shape
    x = x + _row_parallel(layer, attn.astype(x.dtype).reshape(b, t, -1), layer.wo)
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    n = layer.num_shards
    gate, up = _split_shard_groups(_column_parallel(layer, h, layer.w_gate_up), n, (cfg.intermediate_size // n,) * 2)
    return x + _row_parallel(layer, jax.nn.silu(gate) * up, layer.w_down)


def logits(cfg: ModelConfig, params: ModelParams, x: jax.Array) -> jax.Array:
    """Final norm and LM head: x [..., hidden] -> float32 logits [..., vocab]."""
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.batch_invariant:  # a tied table is read in place, as XLA's dot reads embed.T
        def head(h: jax.Array, table: jax.Array) -> jax.Array:
            return matmul(h, table, transpose_w=params.lm_head is None)

        if params.tp is not None:  # replicated: every device computes the whole head, as XLA's dot does
            head = params.tp.per_head(head, (None, None), None)
        out = head(h, params.embed if params.lm_head is None else params.lm_head)
    else:
        out = _dot(h, params.embed.T if params.lm_head is None else params.lm_head)
    return out.astype(jnp.float32)
