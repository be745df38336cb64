"""Lesson 5, convolution: cuDNN bound from Python."""
