"""Lesson 7 — collectives: the ring broadcast and the ring all-reduce, modelled, simulated, on GPUs, and NCCL.

Used by notebooks/07_collectives.ipynb, benchmarks/collectives.py, programs (the rank programs of gpucourse.ranks) and the tests, as
``from kernels import collectives as col``; one module per part of the lesson, imports going one way
(gpu -> stream_model -> specs -> model):

* ``model``: the cost model of a broadcast on a unidirectional ring of k GPUs whose links carry B bytes a
  second: (k - 1) N / B sent whole, N (S + k - 2) / (S B) split into S messages, and with a latency alpha for
  every message (S + k - 2)(alpha + N / (S B)), which has a best S; what the GPUs measure besides (a fixed cost
  t0 a broadcast) and what the host adds when it queues while they run; the ring all-reduce's time; a
  least-squares fit of the parameters to measured times; the all-reduce of a cluster (nodes of 8 GPUs on a
  network), ring against tree, beside published bus bandwidths.
* ``specs``: NumPy specs of the five collectives (broadcast, reduce, all-reduce, all-gather, reduce-scatter), the
  ring broadcast's schedule and the ring all-reduce (reduce-scatter, then all-gather) step by step; the rank
  program of the chunked ring broadcast, for the simulated ring of kernels/collectives/ring_sim.py; a small two-layer
  network in NumPy or CuPy whose gradients the lesson averages across ranks.
* ``stream_model``: the ring broadcast written as stream work (``push_broadcast``) once for real GPUs and for
  ``SimRing``, a CPU model of CUDA streams and events.
* ``gpu``: on real GPUs, ``GpuRing``, the course's ring (peer-to-peer copies on one CUDA stream per link, the
  buffer split into S chunks, CUDA events so that a link forwards chunk i only once it has received it) for any
  k >= 2 GPUs, with a ring all-reduce in two versions: the first, a peer copy into scratch memory and an add
  per step, issued step by step; and the default, one kernel per step that reads the previous GPU's chunk
  over NVLink and adds it in (kernels/cuda/collectives.cu), recorded once as a CUDA graph and replayed.
  ``Nccl``, the same collectives from NVIDIA's library through ``cupy.cuda.nccl``.
"""
import os

# NVLink multicast (NVLS) stays off, so NCCL broadcasts with the rings and trees this lesson compares against (and
# shared multi-GPU servers often require it off). Set before any NCCL communicator is created in this process;
# a value already in the environment wins.
for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)

from .model import (NCCL_NET_STEP_S, PUBLISHED_BUSBW, allreduce_pass_times, allreduce_time, best_chunks,  # noqa: E402
                    broadcast_time, bus_bandwidth, cluster_allreduce_time, fit_host, fit_ring_model, host_paced_time,
                    ring_time, ring_tree_crossover)
from .specs import (COLLECTIVES, allgather_spec, allreduce_spec, broadcast_spec, chunk_bounds, flatten,  # noqa: E402
                    mlp_gradients, mlp_init, reduce_scatter_spec, reduce_spec, ring_allreduce_numpy,
                    ring_broadcast_program, ring_broadcast_schedule, simulate_broadcast, store_and_forward_program,
                    unflatten)
from .stream_model import SimRing, push_broadcast, simulate_gpu_broadcast  # noqa: E402
from .gpu import (ALLREDUCE_GATHERS, ALLREDUCE_METHODS, PEER_ALREADY_ENABLED, REDUCE_KERNELS, SOURCE,  # noqa: E402
                  STEP_BLOCKS_PER_SM, STEP_THREADS, STEP_UNROLL, GpuRing, Nccl, allreduce_options, allreduce_schedule,
                  enable_peer_access, gpu_count, peer_copy, step_grid)

__all__ = [
    "allreduce_pass_times", "allreduce_time", "best_chunks", "broadcast_time", "fit_ring_model",
    "COLLECTIVES", "allgather_spec", "allreduce_spec", "broadcast_spec", "chunk_bounds", "flatten", "mlp_gradients",
    "mlp_init", "reduce_scatter_spec", "reduce_spec", "ring_allreduce_numpy", "ring_broadcast_program",
    "ring_broadcast_schedule", "simulate_broadcast", "store_and_forward_program", "unflatten",
    "SimRing", "push_broadcast", "simulate_gpu_broadcast",
    "ALLREDUCE_GATHERS", "ALLREDUCE_METHODS", "PEER_ALREADY_ENABLED", "REDUCE_KERNELS", "SOURCE",
    "STEP_BLOCKS_PER_SM", "STEP_THREADS", "STEP_UNROLL", "GpuRing", "Nccl", "allreduce_options", "allreduce_schedule",
    "enable_peer_access", "gpu_count", "peer_copy", "step_grid",
]
