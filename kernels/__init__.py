"""The course's GPU kernels: one module or package per lesson, named as the lesson (kernels/vector_multiply.py for
notebooks/01_vector_multiply.ipynb, kernels/inference_engine/ for 06_inference_engine), with its CUDA C in
kernels/cuda/<lesson>*.cu. Each kernel has a NumPy ``*_spec`` beside it.

What a lesson runs beside its kernels without GPU code of its own (simulators, cost models, library bindings,
TensorFlow's side of lesson 9) is in systems/<lesson>/; the tooling every lesson shares is in gpucourse/.
Kernels import only gpucourse's runtime, gpus, bench and cuda_c.
"""
