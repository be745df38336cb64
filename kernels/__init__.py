"""The course's GPU kernels, one module per lesson (CUDA C sources in kernels/cuda/)."""
