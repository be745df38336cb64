"""Lesson 4, convolution: cuDNN bound from Python."""
