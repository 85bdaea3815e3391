"""Fit the simulator's compute constants to timings measured on a real engine (pure; scripts/fit_engine_profile.py
measures). Least squares on small linear models, no numpy needed.

Prefill of one request (seconds): ``base + extend / tokens_per_s + attn x (prefix + extend)^2 / 2``. The last
term is the CPU engine's attention: SGLang's torch_native backend pads each request's query to its whole
context and runs causal SDPA over it (srt/layers/attention/torch_native_backend.py ``_run_sdpa_forward_extend``:
``per_req_query_redudant`` of ``seq_len_kv`` rows), so a cached prefix saves the projections and the MLP of its
tokens but not their attention. Decode step (seconds): ``base + per_seq x batch + per_ctx x context tokens``.
"""

from __future__ import annotations

from typing import Sequence


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Ordinary least squares by the normal equations (Gaussian elimination with partial pivoting). Raises
    ValueError when the design is singular (too few distinct samples)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(k)]
    for c in range(k):
        p = max(range(c, k), key=lambda i: abs(a[i][c]))
        if abs(a[p][c]) < 1e-300:
            raise ValueError("singular design: measure more distinct sizes")
        a[c], a[p] = a[p], a[c]
        for i in range(k):
            if i != c:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
    return [a[i][k] / a[i][i] for i in range(k)]


def _r2(pred: Sequence[float], ys: Sequence[float]) -> float:
    mean = sum(ys) / len(ys)
    ss = sum((y - mean) ** 2 for y in ys)
    return 1.0 - sum((y - p) ** 2 for y, p in zip(ys, pred)) / ss if ss else 1.0


def fit_prefill(samples: Sequence[tuple[int, int, float]]) -> dict:
    """Samples (cached prefix tokens, extended tokens, seconds) -> {base_ms, tokens_per_s,
    attn_s_per_ctx_token2 (seconds per (context tokens)^2 / 2), r2, max_rel_err}. Raises ValueError."""
    rows = [(1.0, float(e), (p + e) ** 2 / 2.0) for p, e, _ in samples]
    ys = [s for _, _, s in samples]
    b, w, k = _lstsq(rows, ys)
    pred = [b + w * r[1] + k * r[2] for r in rows]
    return {"base_ms": b * 1e3, "tokens_per_s": 1.0 / w if w > 0 else float("inf"),
            "attn_s_per_ctx_token2": k, "r2": _r2(pred, ys),
            "max_rel_err": max(abs(p - y) / y for p, y in zip(pred, ys))}


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> dict:
    """Samples (running requests, context tokens summed over them, step seconds) -> {base_ms, per_seq_ms,
    per_ctx_token_us, r2, max_rel_err}. Raises ValueError."""
    rows = [(1.0, float(b), float(c)) for b, c, _ in samples]
    ys = [s for _, _, s in samples]
    b0, per_seq, per_ctx = _lstsq(rows, ys)
    pred = [b0 + per_seq * r[1] + per_ctx * r[2] for r in rows]
    return {"base_ms": b0 * 1e3, "per_seq_ms": per_seq * 1e3, "per_ctx_token_us": per_ctx * 1e6,
            "r2": _r2(pred, ys), "max_rel_err": max(abs(p - y) / y for p, y in zip(pred, ys))}


def sim_settings(measured: dict) -> dict:
    """``kvgate sim-engine`` settings (sim_extra keys) from what scripts/fit_engine_profile.py wrote: its ``fit``
    (prefill_tokens_per_s, prefill_base_ms, decode_base_ms, decode_per_seq_ms, decode_per_ctx_token_us) and/or
    its ``--contention`` ``slowdown`` (host_contention_prefill, host_contention_decode). A constant the least
    squares put below 0 (noise around a term too small to measure) becomes 0; the fit's CPU attention term is
    not carried (the profile's own applies). Raises ValueError when ``measured`` has neither part."""
    out: dict = {}
    fit = measured.get("fit") if isinstance(measured, dict) else None
    slow = measured.get("slowdown") if isinstance(measured, dict) else None
    if not isinstance(fit, dict) and not isinstance(slow, dict):
        raise ValueError("has neither a 'fit' nor a 'slowdown' (write it with scripts/fit_engine_profile.py)")
    try:
        if isinstance(fit, dict):
            pf, dc = fit["prefill"], fit["decode"]
            out.update(prefill_tokens_per_s=round(float(pf["tokens_per_s"]), 1),
                       prefill_base_ms=round(max(0.0, float(pf["base_ms"])), 2),
                       decode_base_ms=round(max(0.0, float(dc["base_ms"])), 3),
                       decode_per_seq_ms=round(max(0.0, float(dc["per_seq_ms"])), 3),
                       decode_per_ctx_token_us=round(max(0.0, float(dc["per_ctx_token_us"])), 3))
            if not out["prefill_tokens_per_s"] > 0 or out["prefill_tokens_per_s"] == float("inf"):
                raise ValueError(f"prefill tokens_per_s {pf['tokens_per_s']!r} is not a throughput")
        if isinstance(slow, dict):
            out.update(host_contention_prefill=round(max(0.0, float(slow["prefill"])), 3),
                       host_contention_decode=round(max(0.0, float(slow["decode"])), 3))
    except (KeyError, TypeError) as e:
        raise ValueError(f"lacks {e}") from None
    return out
