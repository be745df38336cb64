"""Each lesson's GPU measurements, shared by its notebook (GPU mode) and by `python -m gpucourse record`.

A lesson module (benchmarks/<lesson>.py, named as the lesson) has LESSON (its id) and FIGURES, its figures declared
once: ``{name: records.Figure(measure, plot, text)}``. ``record`` stores every figure's measure() (or the module's
own ``run()`` where it has one) and ``record LESSON --figure NAME`` re-measures one; GPUS says how many GPUs the
lesson needs, if more than one. Notebooks call ``figure`` or ``show`` below: measured here on a GPU, else recalled
from the newest record, labelled either way.
"""
import importlib
import textwrap
from typing import NamedTuple

from gpucourse import bench, gpus, records, runtime

LESSONS = {
    "01_vector_multiply": "benchmarks.vector_multiply",
    "02_warp_divergence": "benchmarks.warp_divergence",
    "03_memory": "benchmarks.memory",
    "04_tensor_cores": "benchmarks.tensor_cores",
    "05_convolution": "benchmarks.convolution",
    "06_inference_engine": "benchmarks.inference_engine",
    "07_collectives": "benchmarks.collectives",
    "08_feeding_the_gpu": "benchmarks.feeding_the_gpu",
    "09_training": "benchmarks.training",
    "10_attention": "benchmarks.attention",
}


class Shown(NamedTuple):
    data: dict | None
    source: str  # "measured here on ..." or "recorded on ... on <date>": every table and plot of data carries it


def module(lesson: str):
    if lesson not in LESSONS:
        raise runtime.CourseInputError(f"no lesson {lesson!r}; known: {', '.join(LESSONS)}")
    return importlib.import_module(LESSONS[lesson])


def figures(lesson: str) -> dict:
    """The lesson's figure registry, {name: records.Figure}."""
    return module(lesson).FIGURES


def _figure(lesson: str, name: str) -> records.Figure:
    known = figures(lesson)
    if name not in known:
        raise runtime.CourseInputError(f"{lesson} has no figure {name!r}; its figures: {', '.join(known)}")
    return known[name]


gpu_count = runtime.gpu_count  # GPUs this process sees (0 in CPU mode)


def figure(lesson: str, name: str, measure=None) -> Shown:
    """One figure: measured here in GPU mode on a machine with the GPUs it needs and a GPU that runs its step (the
    registered measure(), or ``measure`` where the notebook measures it another way, e.g. at its own sizes), else
    recalled from the newest record that holds it; with its label."""
    fig = _figure(lesson, name)
    if runtime.is_gpu() and gpu_count() >= fig.gpus:
        status = gpus.status(fig.step) if fig.step else None
        if status is None or status.runs:
            return Shown((measure or fig.measure)(), records.measured_here())
        print(textwrap.fill(status.line(), 100))  # this GPU cannot run it: the record instead
    return Shown(*records.recall(lesson, name, optional=fig.optional))


def show(lesson: str, name: str, measure=None, **context) -> Shown:
    """``figure``, then its text and its label printed and its plot drawn (``context`` goes to the plot)."""
    data, source = shown = figure(lesson, name, measure)
    fig = _figure(lesson, name)
    if data is None:
        print(source)
        return shown
    if fig.text is not None:
        print(fig.text(data))
    print(f"({source})")
    if fig.plot is not None:
        fig.plot(data, source, **context)
    return shown


def run(lesson: str) -> tuple:
    """Every figure of the lesson measured on this GPU, with the GPU's ceilings: (figures, ceilings), for
    ``record``. A lesson whose measurements belong together (one sweep over k GPUs) defines its own ``run()``."""
    mod = module(lesson)
    if hasattr(mod, "run"):
        return mod.run()
    runtime.require_gpu(f"recording {lesson}")
    ceilings = bench.measure_ceilings().as_dict()
    out = {}
    for name, fig in bench.progress(list(figures(lesson).items()), desc=lesson):
        if gpu_count() < fig.gpus:
            print(f"{lesson}: {name!r} needs {fig.gpus} GPUs and this machine has {gpu_count()}; not recorded")
            continue
        if fig.step and not gpus.status(fig.step).runs:
            print(f"{lesson}: {name!r}: {gpus.status(fig.step).line()}; not recorded")
            continue
        out[name] = fig.measure()
    return out, ceilings


def measure_one(lesson: str, name: str) -> dict:
    """One figure measured now on this GPU (``record LESSON --figure NAME``)."""
    runtime.require_gpu(f"recording {lesson}'s {name!r}")
    return _figure(lesson, name).measure()
