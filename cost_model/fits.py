"""The calibrations' fits: a latency and a rate (`fit_latency_rate`), a least-squares line (`fit_line`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_latency_rate(amounts: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit t = latency + amount / rate (weighted by 1/t so small sizes count): (latency, rate).

    The latency is clamped at 0 (a negative fit means the latency is below the noise); the rate is
    then refit through the origin.
    """
    x = np.asarray(amounts, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.size < 2:
        raise ValueError(f"need >= 2 (amount, seconds) pairs of equal length, got {x.size} and {t.size}")
    w = 1.0 / t
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (latency, inv_rate), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if latency < 0:
        latency = 0.0
        inv_rate = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if inv_rate <= 0:
        raise ValueError("timings do not grow with size: cannot fit a rate")
    return float(latency), float(1.0 / inv_rate)


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope * x (`cost_model.calibrate` fits with it too)."""
    slope, intercept = np.polyfit(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), 1)
    return float(intercept), float(slope)
