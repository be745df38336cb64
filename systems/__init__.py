"""What a lesson runs beside its kernels, with no GPU kernel of its own, one package per lesson named as the lesson:

  systems/convolution/cudnn.py         lesson 5: cuDNN's C API bound from Python (CuPy 14 has no cuDNN module)
  systems/feeding_the_gpu/             lesson 8: the stream simulator CPU mode draws, the MPS experiment's client
                                       processes (serving.py), the dynamic batcher
  systems/training/tensorflow_reference.py
                                       lesson 9: the same network in TensorFlow, the oracle of the course's step

The NumPy models a lesson's kernels are checked against (a warp's lanes, the ring's steps) stay beside the kernels
in kernels/. Imports go one way: systems may use kernels and gpucourse; kernels never import systems.
"""
