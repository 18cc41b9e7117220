"""float64 NumPy references for the pallas_kernels tests (no JAX inside)."""

from __future__ import annotations

import numpy as np


def per_batch(value, batch: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(value, dtype=np.int64), (batch,))


def attention_ref(q, k, v, *, causal=False, q_offset=0, kv_len=None, kv_start=None, q_positions=None,
                  sm_scale=None):
    """o [B, Tq, Hq, D] and lse [B, Hq, Tq] in float64; rows with no visible key: o=0, lse=-inf.
    kv_start [B, Tq]: query i sees no key j < kv_start[b, i]; q_positions [B, Tq]: query i's position
    (default q_offset + i)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    q_offset = per_batch(q_offset, batch)
    kv_len = per_batch(tk if kv_len is None else kv_len, batch)
    o = np.zeros((batch, tq, hq, d))
    lse = np.full((batch, hq, tq), -np.inf)
    for b in range(batch):
        rows = (q_offset[b] + np.arange(tq) if q_positions is None else np.asarray(q_positions)[b])[:, None]
        cols = np.arange(tk)[None, :]
        vis = cols < kv_len[b]
        if causal:
            vis = vis & (cols <= rows)
        if kv_start is not None:
            vis = vis & (cols >= np.asarray(kv_start)[b][:, None])
        for h in range(hq):
            kh = h // group
            s = q[b, :, h] @ k[b, :, kh].T * scale
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            seen = np.isfinite(m[:, 0])
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            l = p.sum(axis=1)
            o[b, :, h] = np.where(seen[:, None], (p @ v[b, :, kh]) / np.where(seen, l, 1)[:, None], 0)
            lse[b, h] = np.where(seen, m[:, 0] + np.log(np.where(seen, l, 1)), -np.inf)
    return o, lse


def decode_ref(q, k, v, *, kv_len=None, sm_scale=None):
    """Decode = one query row that sees keys [0, kv_len): o [B, Hq, D], lse [B, Hq]."""
    o, lse = attention_ref(np.asarray(q)[:, None], k, v, kv_len=kv_len, sm_scale=sm_scale)
    return o[:, 0], lse[..., 0]


def merge_ref(os_, lses):
    """N-way merge in float64; os_ [N, B, T, H, D] (attention layout), lses [N, B, H, T]."""
    os_ = np.asarray(os_, dtype=np.float64)
    lses = np.asarray(lses, dtype=np.float64)
    lse_t = np.swapaxes(lses, -1, -2)  # [N, B, T, H]
    m = lse_t.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse_t - m_safe)
    total = w.sum(axis=0)
    parts = np.where(w[..., None] > 0, w[..., None] * np.nan_to_num(os_), 0.0)  # empty: ignored
    o = np.where(total[..., None] > 0,
                 parts.sum(axis=0) / np.where(total > 0, total, 1)[..., None], 0)
    lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1)), -np.inf)
    return o, np.swapaxes(lse, -1, -2)


def xattn_block_sums_ref(q, k, *, stride, block_size, causal=True, q_offset=0, kv_len=None,
                         sm_scale=None):
    """One-shot XAttention block sums in float64: [B, Hq, ceil(Mq/r), ceil(Mk/r)], r = block/stride.

    Antidiagonal score of query tile i and key tile j (tiles of `stride` rows, zero padded):
    sum_s q[i*S + S-1-s] . k[j*S + s], times sm_scale / S. Tile j is visible to tile i iff
    j*S < kv_len and (not causal or j*S <= q_offset + i*S); keys >= kv_len count as zero.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    batch, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    S = stride
    r = block_size // S
    scale = (1.0 / np.sqrt(d) if sm_scale is None else sm_scale) / S
    mq, mk = -(-tq // S), -(-tk // S)
    qp = np.zeros((batch, mq * S, hq, d)); qp[:, :tq] = q
    q_offset = per_batch(q_offset, batch)
    kv_len = per_batch(tk if kv_len is None else kv_len, batch)
    kp = np.zeros((batch, mk * S, hkv, d))
    for bi in range(batch):  # keys past kv_len count as zero
        kp[bi, :min(tk, kv_len[bi])] = k[bi, :kv_len[bi]]
    qr = qp.reshape(batch, mq, S, hq, d)[:, :, ::-1]  # reversed inside each tile
    kr = kp.reshape(batch, mk, S, hkv, d)
    nqb, nkb = -(-mq // r), -(-mk // r)
    out = np.zeros((batch, hq, nqb, nkb))
    for b in range(batch):
        ti = np.arange(mq)[:, None] * S
        tj = np.arange(mk)[None, :] * S
        vis = tj < kv_len[b]
        if causal:
            vis = vis & (tj <= q_offset[b] + ti)
        for h in range(hq):
            s = np.einsum("isd,jsd->ij", qr[b, :, :, h], kr[b, :, :, h // group]) * scale
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            p = np.where(l > 0, p / np.where(l > 0, l, 1), 0)
            pp = np.zeros((nqb * r, nkb * r)); pp[:mq, :mk] = p
            out[b, h] = pp.reshape(nqb, r, nkb, r).sum(axis=(1, 3))
    return out


def select_blocks_ref(block_sums, *, threshold, block_size, q_offset=0):
    """Per query block keep the fewest key blocks whose cumulative mass reaches threshold.

    q_offset: int or per-batch list. The first key block and the diagonal block (containing
    position q_offset + qb*block_size)
    are always kept and count first; the others follow in
    descending order; a block is kept while the mass before it is below threshold * total.
    """
    bs = np.asarray(block_sums, dtype=np.float64)
    batch, hq, nqb, nkb = bs.shape
    q_offset = per_batch(q_offset, batch)
    mask = np.zeros(bs.shape, dtype=bool)
    for b in range(batch):
        for h in range(hq):
            for i in range(nqb):
                row = bs[b, h, i]
                forced = np.zeros(nkb, dtype=bool)
                forced[0] = True
                diag = (q_offset[b] + i * block_size) // block_size
                if diag < nkb:
                    forced[diag] = True
                need = threshold * row.sum()
                acc = row[forced].sum()
                keep = forced.copy()
                order = sorted((j for j in range(nkb) if not forced[j] and row[j] > 0),
                               key=lambda j: (-row[j], j))
                for j in order:
                    if acc >= need:
                        break
                    keep[j] = True
                    acc += row[j]
                mask[b, h, i] = keep
    return mask


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref| over finite entries (0 when ref is all zero and x matches)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.max(np.abs(ref)) if ref.size else 0.0
    diff = np.max(np.abs(x - ref)) if ref.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


def assert_attention_close(o, lse, ref_o, ref_lse, tol: float, lse_tol: float = 1e-5, seed: int | None = None):
    """o within `tol` relative, finite lse within lse_tol absolute, empty rows exactly (0, -inf); a failure names
    `seed` when given.

    o is [..., T, H, D] with lse [..., H, T] (prefill) or o [..., H, D] with lse [..., H].
    """
    try:
        _check_attention_close(o, lse, ref_o, ref_lse, tol, lse_tol)
    except AssertionError as e:
        if seed is None:
            raise
        raise AssertionError(f"seed {seed}: {e}") from None


def _check_attention_close(o, lse, ref_o, ref_lse, tol: float, lse_tol: float):
    o = np.asarray(o, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN in the result"
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    empty = ~np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), "rows with no visible key must get lse=-inf"
    empty_o = np.swapaxes(empty, -1, -2) if o.ndim == 4 else empty
    assert np.all(o[empty_o] == 0.0), "rows with no visible key must get o=0"
    err = rel_err(o, ref_o)
    assert err <= tol, f"o relative error {err:.3e} > {tol:.0e}"
    if (~empty).any():
        lerr = float(np.max(np.abs(lse[~empty] - ref_lse[~empty])))
        assert lerr <= lse_tol, f"lse absolute error {lerr:.3e} > {lse_tol:.0e}"


def block_sparse_attention_ref(q, k, v, block_mask, *, block_size, causal=False, q_offset=0,
                               kv_len=None, sm_scale=None):
    """attention_ref where query block i of head h also needs block_mask[b, h, i, j // block_size].

    block_mask: bool [B, Hq, ceil(Tq / block_size), nkb]; key blocks past nkb are not visited.
    Returns o [B, Tq, Hq, D] and lse [B, Hq, Tq] in float64 (empty rows: o=0, lse=-inf).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    block_mask = np.asarray(block_mask, dtype=bool)
    batch, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    q_offset = per_batch(q_offset, batch)
    kv_len = per_batch(tk if kv_len is None else kv_len, batch)
    qb = np.arange(tq) // block_size
    kb = np.arange(tk) // block_size
    o = np.zeros((batch, tq, hq, d))
    lse = np.full((batch, hq, tq), -np.inf)
    for b in range(batch):
        rows = q_offset[b] + np.arange(tq)[:, None]
        cols = np.arange(tk)[None, :]
        vis = cols < kv_len[b]
        if causal:
            vis = vis & (cols <= rows)
        for h in range(hq):
            mask = block_mask[b, h]
            listed = np.zeros((tq, tk), dtype=bool)
            in_range = kb < mask.shape[1]
            listed[:, in_range] = mask[qb][:, kb[in_range]]
            kh = h // group
            s = np.where(vis & listed, q[b, :, h] @ k[b, :, kh].T * scale, -np.inf)
            m = s.max(axis=1)
            seen = np.isfinite(m)
            m = np.where(seen, m, 0.0)
            p = np.exp(s - m[:, None])
            l = np.where(seen, p.sum(axis=1), 1.0)
            o[b, :, h] = np.where(seen[:, None], (p @ v[b, :, kh]) / l[:, None], 0.0)
            lse[b, h] = np.where(seen, m + np.log(l), -np.inf)
    return o, lse
