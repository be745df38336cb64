"""Each lesson's GPU measurements, shared by its notebook (GPU mode) and by `python -m gpucourse record`.

A lesson module has LESSON (its id), FIGURES (the keys it records), run() -> (figures, ceilings), GPUS (the
GPUs run() needs, if more than one; `record` of every lesson skips it on smaller machines),
plus the plotting functions
its notebook uses for both measured and recorded figures.
"""
import importlib

LESSONS = {
    "01_vector_multiply": "benchmarks.vector_multiply",
    "02_warp_divergence": "benchmarks.warp_divergence",
    "03_tensor_cores": "benchmarks.tensor_cores",
    "04_convolution": "benchmarks.convolution",
    "05_inference_engine": "benchmarks.inference_engine",
    "06_collectives": "benchmarks.collectives",
    "07_feeding_the_gpu": "benchmarks.feeding",
    "08_training": "benchmarks.training",
}


def module(lesson: str):
    return importlib.import_module(LESSONS[lesson])
