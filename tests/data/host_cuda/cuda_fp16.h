// Stands in for CUDA's cuda_fp16.h when tests/data/collectives_on_host.cpp compiles kernels/cuda/collectives.cu
// for the CPU: that file defines __half and the intrinsics the kernels use before it includes the source.
#pragma once
