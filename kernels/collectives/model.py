"""Lesson 7: the cost model of a ring. A broadcast of N bytes over k GPUs whose links carry B bytes a second:
(k - 1) N / B sent whole, N (S + k - 2) / (S B) split into S messages, and with a latency alpha for every message
(S + k - 2)(alpha + N / (S B)), which has a best S; the ring all-reduce's time, and what moving its bytes costs in
each of GpuRing's versions; a least-squares fit of alpha, B (and a start-up cost) to measured times."""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime


def _check_model_args(N, B, k, S=1, alpha=0.0):
    if not (N >= 0 and B > 0 and alpha >= 0):
        raise runtime.CourseInputError(f"need N >= 0, B > 0 and alpha >= 0 (got N={N}, B={B}, alpha={alpha})")
    if int(k) != k or k < 2:
        raise runtime.CourseInputError(f"a ring needs k >= 2 GPUs, got k = {k}")
    if int(S) != S or S < 1:
        raise runtime.CourseInputError(f"S is a number of messages, at least 1; got S = {S}")


def broadcast_time(N: float, B: float, k: int, S: int = 1, alpha: float = 0.0) -> float:
    """Seconds for a ring broadcast of N bytes to k GPUs over links of B bytes/s, the data split into S
    messages each costing alpha seconds more: S + k - 2 steps of alpha + N / (S B). S = 1, alpha = 0 is the
    slide's (k - 1) N / B; alpha = 0 is its N (S + k - 2) / (S B), which tends to N / B as S grows."""
    _check_model_args(N, B, k, S, alpha)
    return (S + k - 2) * (alpha + N / (S * B))


def best_chunks(N: float, B: float, k: int, alpha: float, max_chunks: int | None = None) -> int:
    """The S that minimises broadcast_time. T(S) = (k - 2) N / (S B) + S alpha + constants is least at
    S* = sqrt((k - 2) N / (alpha B)); the best whole S is the floor or the ceiling of it."""
    _check_model_args(N, B, k, 1, alpha)
    if k == 2:
        return 1  # two GPUs, one link: splitting only adds latency
    if alpha == 0:
        if max_chunks is None:
            raise runtime.CourseInputError("with alpha = 0 more messages are always faster: give max_chunks")
        return int(max_chunks)
    s = math.sqrt((k - 2) * N / (alpha * B))
    candidates = {max(1, math.floor(s)), max(1, math.ceil(s))}
    if max_chunks is not None:
        candidates = {min(c, int(max_chunks)) for c in candidates}
    return min(sorted(candidates), key=lambda c: broadcast_time(N, B, k, c, alpha))


def allreduce_time(N: float, B: float, k: int, alpha: float = 0.0) -> float:
    """Seconds for a ring all-reduce of N bytes: k - 1 steps of reduce-scatter and k - 1 of all-gather,
    each moving a chunk of N / k bytes over every link at once."""
    _check_model_args(N, B, k, 1, alpha)
    return 2 * (k - 1) * (alpha + N / (k * B))


def allreduce_pass_times(N: float, B: float, M: float, k: int) -> dict:
    """Seconds that moving the bytes of a ring all-reduce of N bytes takes in each of GpuRing's versions, with
    links of B bytes/s and memory of M bytes/s (bytes read plus written); no latency, no host. Both send
    2 (k - 1) chunks of c = N / k over every link, c / B a step. "copy-add" then adds after each of the k - 1
    reduce-scatter copies, reading the scratch chunk and its own and writing the sum (3 c bytes, 3 c / M), once
    the copy has ended. "pull" reads and writes its own chunk (2 c bytes) in the kernel that brings the peer's
    chunk over the link, while the link works: max(c / B, 2 c / M) a step."""
    _check_model_args(N, B, k)
    if not M > 0:
        raise runtime.CourseInputError(f"need a memory bandwidth M > 0, got {M}")
    c = N / k
    return {"copy-add": 2 * (k - 1) * c / B + (k - 1) * 3 * c / M,
            "pull": (k - 1) * max(c / B, 2 * c / M) + (k - 1) * c / B}


def fit_ring_model(k, S, N, seconds, *, startup: bool = False) -> dict:
    """Least-squares alpha (seconds a message) and B (bytes/s) of broadcast_time to measured times.

    The model is linear in alpha and 1/B: t = (S + k - 2) alpha + (S + k - 2) / S * N * (1/B). With
    ``startup=True`` it also fits a fixed cost t0 per broadcast (starting the operation and waiting for its
    end, whatever S and N): t = t0 + (S + k - 2)(alpha + N / (S B)). Each point is weighted by 1/t, so the
    fit minimises relative errors (a 2 ms point counts as much as a 20 µs one).

    Every parameter is a time, so none may be negative: where the best unconstrained fit wants a negative
    alpha or t0 (the times do not grow with S as the model says, or a term of the model is missing), the fit
    is the best one with that parameter at 0, named in ``pinned``; a model that only fits with a negative time
    is a model that does not describe the measurements, and the errors then show by how much.
    Returns alpha, bandwidth, startup_s, pinned, the model's times and each point's relative error."""
    k, S, N, t = (np.broadcast_to(np.asarray(v, float), np.shape(seconds)) for v in (k, S, N, seconds))
    if t.size < 2 + startup or np.any(t <= 0):
        raise runtime.CourseInputError("fit_ring_model needs at least two (three with startup) positive times")
    steps = S + k - 2
    names = ["alpha_s", "inverse_bandwidth"] + (["startup_s"] if startup else [])
    X = np.stack([steps, steps / S * N] + ([np.ones_like(t)] if startup else []), axis=1)
    coef = _nonnegative_lstsq(X / t[:, None], np.ones_like(t))
    if coef[1] <= 0:
        raise runtime.CourseError("the fit gave a bandwidth <= 0: the times do not follow the model")
    model = X @ coef
    rel = (t - model) / model
    return {"alpha_s": float(coef[0]), "bandwidth": float(1 / coef[1]),
            "startup_s": float(coef[2]) if startup else 0.0,
            "pinned": [n for n, c in zip(names, coef) if c == 0.0 and n != "inverse_bandwidth"],
            "model_s": model.tolist(), "rel_error": rel.tolist(), "max_abs_rel_error": float(np.abs(rel).max())}


def _nonnegative_lstsq(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |A x - b| over x >= 0, for the two or three columns of a ring model: the best of the least-squares
    fits on every subset of the columns (the others held at 0) whose coefficients are all >= 0. With so few
    columns trying every subset is exact and simple (the active-set method of Lawson and Hanson finds the
    same answer for many columns)."""
    n = A.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if np.all(x >= 0):
            full = np.zeros(n)
            full[cols] = x
            res = float(np.sum((A @ full - b) ** 2))
            if res < best_res - 1e-15 * max(best_res, 1.0):
                best, best_res = full, res
    return best


# ---------------------------------------------------------------- what the GPUs measure, and what the host adds

def ring_time(N: float, B: float, k: int, S: int, alpha: float, t0: float = 0.0) -> float:
    """The ring broadcast the lesson measures on GPUs: t0 + (S + k - 2)(alpha + N / (S B)). Each term is a
    measurement: t0 the fixed cost of one broadcast (the streams' fork and join, the first copy's start; about
    one small copy's time), alpha the cost of each further message on a link (a copy engine starting the next
    copy), B the bandwidth of one link (one large peer copy)."""
    _check_model_args(N, B, k, S, alpha)
    if t0 < 0:
        raise runtime.CourseInputError(f"t0 is a time, not {t0}")
    return t0 + broadcast_time(N, B, k, S, alpha)


def host_paced_time(N: float, B: float, k: int, S: int, alpha: float, t0: float, host_s: float,
                    host_t0: float = 0.0) -> float:
    """The same broadcast when the host queues it while the GPUs run: Python queues (k - 1) S copies, host_s
    seconds each (a copy and an event), so the last copy cannot start before host_t0 + (k - 1) S host_s; the
    broadcast ends after whichever is later, the GPUs' pipeline or the host's queue plus the last message."""
    gpu = ring_time(N, B, k, S, alpha, t0)
    host = host_t0 + (k - 1) * S * host_s + alpha + N / (S * B)
    return max(gpu, host)


def fit_host(k: int, S, host_seconds) -> dict:
    """host_s (seconds to queue one message) and host_t0 from the host's measured time to queue a broadcast of S
    messages: a straight line in (k - 1) S, fitted by least squares, both parameters kept >= 0."""
    x = (k - 1) * np.asarray(S, float)
    t = np.asarray(host_seconds, float)
    if x.size < 2 or np.any(t <= 0):
        raise runtime.CourseInputError("fit_host needs two or more positive times")
    coef = _nonnegative_lstsq(np.stack([x, np.ones_like(x)], axis=1), t)
    return {"host_s": float(coef[0]), "host_t0": float(coef[1])}


# ------------------------------------------------------------------------- at scale, on paper

def cluster_allreduce_time(N: float, nodes: int, algo: str = "ring", *, gpus_per_node: int = 8,
                           nvlink_bw: float, nic_bw: float, nics_per_node: int = 8,
                           alpha_nvlink: float, alpha_net: float) -> float:
    """Seconds for an all-reduce of N bytes over ``nodes`` nodes of ``gpus_per_node`` GPUs, NVLink inside a node and
    one network link (NIC) per channel between nodes, as NCCL's own tuning model counts it (src/graph/tuning.cc):

    * ring: 2 (p - 1) steps for p GPUs, 2 (nodes - 1) of them over the network: latency
      (2 (p - 1) - 2 (nodes - 1)) alpha_nvlink + 2 (nodes - 1) alpha_net, growing with p; bytes 2 (p - 1) / p N at the
      bus bandwidth, min(nvlink_bw, nics_per_node nic_bw) once the ring leaves the node (nics_per_node rings, one a NIC);
    * tree (a chain inside each node, a double binary tree across nodes): latency
      2 ((gpus_per_node - 1) alpha_nvlink + log2(nodes) alpha_net), growing with log p; bytes 2 N at the same bus
      bandwidth (each GPU sends and receives the whole buffer up and down the tree).
    """
    if algo not in ("ring", "tree"):
        raise runtime.CourseInputError(f"algo is 'ring' or 'tree', not {algo!r}")
    if int(nodes) != nodes or nodes < 1 or int(gpus_per_node) != gpus_per_node or gpus_per_node < 1:
        raise runtime.CourseInputError(f"need whole numbers nodes >= 1 and gpus_per_node >= 1 (got {nodes}, {gpus_per_node})")
    if not (N >= 0 and nvlink_bw > 0 and nic_bw > 0 and alpha_nvlink >= 0 and alpha_net >= 0 and nics_per_node >= 1):
        raise runtime.CourseInputError("need N >= 0, bandwidths > 0, latencies >= 0 and at least one NIC a node")
    p = nodes * gpus_per_node
    if p < 2:
        return 0.0
    bus = nvlink_bw if nodes == 1 else min(nvlink_bw, nics_per_node * nic_bw)
    if algo == "ring":
        steps, inter = 2 * (p - 1), 2 * (nodes - 1)
        return (steps - inter) * alpha_nvlink + inter * alpha_net + 2 * (p - 1) / p * N / bus
    return 2 * ((gpus_per_node - 1) * alpha_nvlink + math.log2(nodes) * alpha_net) + 2 * N / bus


def bus_bandwidth(N: float, p: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: the algorithm bandwidth N / t times 2 (p - 1) / p, the bytes each
    GPU's links carry per byte of buffer in a ring, so that it reads as a link speed whatever p is."""
    return N / seconds * 2 * (p - 1) / p


def ring_tree_crossover(nodes: int, **params) -> float:
    """The buffer size (bytes) above which the ring all-reduce beats the tree on ``nodes`` nodes (its latency grows
    with p, its bytes slightly fewer), by bisection on the two models; 0 where the ring is never slower."""
    def gap(n):
        return cluster_allreduce_time(n, nodes, "ring", **params) - cluster_allreduce_time(n, nodes, "tree", **params)

    lo, hi = 1.0, 2.0 ** 50
    if gap(lo) <= 0:
        return 0.0
    if gap(hi) > 0:
        return math.inf
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return hi


# Published all-reduce bus bandwidths of clusters like those the prediction describes, with where they come from.
# Each is one party's reading of nccl-tests on its own machines; none was measured by this course.
PUBLISHED_BUSBW = [
    {"nodes": 1, "gpus_per_node": 8, "N": None, "busbw_gbps": (370.0, 370.0), "algo": "ring",
     "what": "8 H100 in one node, NCCL's ring over NVLink (NVLink SHARP off), large buffers",
     "source": "NCCL developer (sjeaugey), https://github.com/NVIDIA/nccl-tests/issues/212 (2024-05-06): "
               "'NCCL can get an effective NVLink bandwidth of 370GB/s ... when running with NCCL_ALGO=RING'"},
    {"nodes": 2, "gpus_per_node": 8, "N": None, "busbw_gbps": (8 * 46.0, 8 * 48.0), "algo": "ring",
     "what": "H100 nodes with 8 ConnectX-7 NICs at NDR 400 Gb/s: 46-48 GB/s per NIC, times 8 NICs",
     "source": "NCCL developer (AddyLaddy), https://github.com/NVIDIA/nccl-tests/issues/290 (2025-03-03): "
               "'For NDR @ 400Gbps you should see 46-48GB/s per NIC' (NCCL_ALGO=RING on two nodes)"},
    {"nodes": 248, "gpus_per_node": 8, "N": 512 * 2**20, "busbw_gbps": (300.0, 350.0), "algo": "default",
     "what": "248 nodes of 8 H200 (1,984 GPUs), 8 NICs a node, 512 MiB, NCCL's default algorithm: 'typically "
             "around 350G, but occasionally dropping below 300G'",
     "source": "a user's report, https://github.com/NVIDIA/nccl-tests/issues/283 (2025-01-18)"},
]
# NCCL's own estimate of one network step of its ring (Simple protocol, microseconds), from its tuning model
# (hwLat[NCCL_HW_NET][ring][simple] in https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc, NCCL 2.7-era
# table); the course has no network to measure it on.
NCCL_NET_STEP_S = 9.6e-6
