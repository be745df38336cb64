"""Lesson 7, feeding and sharing the GPU: the stream simulator CPU mode draws, and the dynamic batcher."""
