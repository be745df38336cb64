"""Lesson 10 — attention: softmax as a memory-bound kernel, attention the naive way, and FlashAttention's forward and
backward passes (numba, CUDA C on the tensor cores, Triton), one module per part:

* ``specs``: NumPy references in float64 (softmax three-pass and online, the merge rule of two partial softmax
  sums, attention's forward with its log-sum-exp and its backward), and what attention costs (FLOPs, bytes, which
  ceiling binds);
* ``row_softmax``: row softmax kernels in numba and CUDA C (kernels/cuda/attention.cu), three-pass and one-pass;
* ``naive``: S = Q K^T, softmax, P V with S and P whole in memory (cuBLAS through CuPy);
* ``flash``: FlashAttention's forward pass, a readable numba kernel, the WMMA tensor-core kernel (sm_80+),
  FlashAttention-2's shape on mma.sync (sm_80+: S, P and O in registers) and Hopper's (wgmma fed by the TMA, a
  producer warpgroup and two consumers, FlashAttention-3's structure), and the forward in FP8 on Hopper (flash_fp8);
* ``triton_kernels``: the forward and the backward in Triton;
* ``backward_tiles``: the backward pass tile by tile as a GPU kernel runs it (dQ by atomics or a second pass), in
  NumPy, with what it computes and recomputes;
* ``backward_cuda``: that backward in CUDA C on Hopper (wgmma fed by the TMA; dQ by the TMA's atomic adds);
* ``fp8``: the FP8 (e4m3) forward's numerics in NumPy (block scales, P scaled for e4m3, the random Hadamard rotation of
  Q and K) beside the same tiles in FP16;

Layout everywhere: (batch, heads, N, d), contiguous; float16 on the GPU kernels.
"""
from .specs import (attention_backward_spec, attention_bytes, attention_flops, attention_spec, bound, check_qkv,
                    merge_partials, online_softmax_spec, scores_spec, softmax_naive, softmax_spec)
from .row_softmax import softmax, softmax_cuda_c, softmax_online_numba, softmax_three_pass_numba
from .naive import check_fits, naive_attention, naive_bytes
from .flash import (FP8_KEY_ORDER, flash_forward_numba, flash_fp8, flash_mma, flash_numba, flash_wgmma, flash_wmma,
                    fp8_operands, fp8_v_transposed, mma_smem_bytes, mma_variant, mma_variants, wgmma_smem_bytes,
                    wmma_missing, wmma_smem_bytes)
from .backward_cuda import flash_backward_wgmma
