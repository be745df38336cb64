"""Lesson 8, feeding and sharing the GPU: the stream simulator CPU mode draws, the client processes of the MPS
experiment (serving), and the dynamic batcher."""
