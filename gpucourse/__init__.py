"""The course's tooling: runtime (GPU or CPU mode), bench (timing, ceilings), plots, records, grading.

A notebook starts with ``rt = gpucourse.setup(lesson="01_vector_multiply")``.
"""
from .runtime import setup

__version__ = "0.1.0"
__all__ = ["setup"]
