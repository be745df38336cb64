"""Lesson 8 — throughput against latency: batch statistics and a dynamic batcher.

A server that runs one request at a time keeps every request's latency low and the GPU mostly idle; one
that waits for full batches keeps the GPU busy and makes early requests wait. A *dynamic batcher* (what
Triton and TF Serving do) takes whatever has arrived, up to ``max_batch``, but never lets the oldest request
wait longer than ``max_wait`` before starting a batch.

``dynamic_batching`` plays a stream of arrivals through that rule. Each batch's service time comes from
``service(n)``: on a GPU the benchmark passes a function that really runs lesson 6's engine on n images and
returns the time it took, so the queueing is computed on the clock of real GPU work (no sleeping: arrivals
are a list of times, the server's clock advances by each batch's measured time).
"""
from __future__ import annotations

import numpy as np

from gpucourse import runtime


def latency_summary(samples_ms, batch: int) -> dict:
    """p50 and p99 of per-call latencies (ms) of batches of ``batch`` images, and images/s at the median."""
    s = np.asarray(samples_ms, np.float64)
    if s.ndim != 1 or s.size == 0 or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise runtime.CourseInputError("samples_ms must be a non-empty list of positive times in ms")
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise runtime.CourseInputError(f"batch must be a positive int, got {batch!r}")
    p50, p99 = np.percentile(s, [50, 99])
    return {"batch": int(batch), "p50_ms": float(p50), "p99_ms": float(p99), "images_per_s": batch * 1e3 / float(p50)}


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0) -> np.ndarray:
    """``count`` arrival times (s) of requests arriving at random at ``rate_per_s`` on average."""
    if rate_per_s <= 0 or count < 1:
        raise runtime.CourseInputError("the rate must be positive and count at least 1")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, count)
    return np.cumsum(gaps) - gaps[0]


def dynamic_batching(arrivals, service, *, max_batch: int, max_wait: float) -> dict:
    """Serve requests arriving at times ``arrivals`` (s, non-decreasing) with one server and the dynamic
    batching rule; ``service(n)`` is the time (s) a batch of n takes.

    A batch starts when the server is free and either ``max_batch`` requests wait or the oldest waiting
    request has waited ``max_wait``; it takes every waiting request, up to ``max_batch``. Returns each
    request's latency (end of its batch minus its arrival), the batch sizes, the throughput, and how long
    the server was busy (``busy_s``, of ``span_s`` from the first arrival to the last batch's end)."""
    t = np.asarray(arrivals, np.float64)
    if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)) or np.any(np.diff(t) < 0):
        raise runtime.CourseInputError("arrivals must be a non-empty, non-decreasing list of finite times")
    if not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
        raise runtime.CourseInputError(f"max_batch must be a positive int, got {max_batch!r}")
    if not np.isfinite(max_wait) or max_wait < 0:
        raise runtime.CourseInputError(f"max_wait must be a finite time >= 0, got {max_wait}")
    latency = np.empty_like(t)
    sizes, free, busy, i = [], 0.0, 0.0, 0
    while i < t.size:
        full = t[i + max_batch - 1] if i + max_batch - 1 < t.size else np.inf
        start = max(free, min(t[i] + max_wait, full))
        j = i
        while j < t.size and j - i < max_batch and t[j] <= start:
            j += 1
        took = float(service(j - i))
        if not np.isfinite(took) or took <= 0:
            raise runtime.CourseInputError(f"service({j - i}) returned {took!r}: a batch takes a positive time")
        end = start + took
        latency[i:j] = end - t[i:j]
        sizes.append(j - i)
        free, busy, i = end, busy + took, j
    span = free - t[0]
    return {"latency_s": latency, "batch_sizes": np.array(sizes), "span_s": span, "busy_s": busy,
            "throughput_per_s": t.size / span if span > 0 else float("inf")}
