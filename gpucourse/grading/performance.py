"""Performance tests cannot be gamed by what the candidate does (``performance_points``; see its docstring):
the harness makes fresh inputs for every run (and refuses a ``make_inputs`` that repeats itself), poisons the
output before every run and checks it right after, brackets every run with CUDA events around a
device-wide synchronisation (work left running on another stream is timed too), interleaves candidate and
reference runs in the same process, and uses only CuPy's own event and synchronisation functions, checked
to be the genuine ones before and after timing: caching across calls, deferred or batched work and patched
timers or clocks get 0 points or are timed for what they really do.

The points: full marks up to ``FULL_AT`` times the reference's time, none from ``ZERO_AT`` (``performance_score``).
"""
from __future__ import annotations

from collections.abc import Callable

from .. import gpus, runtime
from .reports import number
from .settings import CPU_PERF_MESSAGE, FULL_AT, GPUS_MESSAGE, GPUS_PERF_MESSAGE, SOFTWARE_MESSAGE, STEP_PERF_MESSAGE, ZERO_AT
from .verdicts import first_lines


def performance_score(ratio: float, max_points: float) -> float:
    """Points for running ``ratio`` times as long as the reference: all up to FULL_AT, none from ZERO_AT,
    linear in between (rounded down to 0.01)."""
    if not ratio > 0 or max_points < 0:
        raise runtime.CourseInputError(f"need a positive ratio and points >= 0, got ratio={ratio}, points={max_points}")
    if ratio <= FULL_AT:
        return float(max_points)
    if ratio >= ZERO_AT:
        return 0.0
    points = max_points * (ZERO_AT - ratio) / (ZERO_AT - FULL_AT)
    return float(int(points * 100 + 1e-9) / 100)


class _WrongOutput(Exception):
    pass


class _Tampered(Exception):
    pass


_CUDA_TIMING = ("eventCreate", "eventRecord", "eventSynchronize", "eventElapsedTime", "eventDestroy",
                "deviceSynchronize")


class _CudaClock:
    """Times f(*args) on the GPU: a CUDA event on the legacy default stream, f, a device-wide
    synchronisation (so work f left on any other stream is timed too), a second event.

    It calls CuPy's compiled bindings of the CUDA runtime (cupy.cuda.runtime.event*, deviceSynchronize),
    checked to be those compiled functions and held from the start: a notebook that replaced them, or
    replaces them while it is being timed, gets 0 points (``verify``)."""

    def __init__(self, cp):
        import types

        self.module = cp.cuda.runtime
        self.fns = {}
        for name in _CUDA_TIMING:
            fn = getattr(self.module, name, None)
            owner = getattr(getattr(fn, "__self__", None), "__name__", None)
            if type(fn) is not types.BuiltinFunctionType or fn.__name__ != name or \
                    owner != "cupy_backends.cuda.api.runtime":
                raise _Tampered(f"cupy.cuda.runtime.{name} is not CuPy's own function: the notebook replaced it")
            self.fns[name] = fn
        self.cp = cp

    def verify(self) -> None:
        for name, fn in self.fns.items():
            if getattr(self.module, name, None) is not fn:
                raise _Tampered(f"the notebook replaced cupy.cuda.runtime.{name} while it was being timed")

    def time(self, fn: Callable, args: tuple) -> float:
        f = self.fns
        start, end = f["eventCreate"](), f["eventCreate"]()
        try:
            f["deviceSynchronize"]()
            f["eventRecord"](start, 0)
            fn(*args)
            f["deviceSynchronize"]()
            f["eventRecord"](end, 0)
            f["eventSynchronize"](end)
            return float(f["eventElapsedTime"](start, end))
        finally:
            f["eventDestroy"](start)
            f["eventDestroy"](end)

    def sample(self, x):
        return self.cp.asnumpy(x)



def _poison(out, rng) -> None:
    """Fill ``out`` with values no correct run leaves behind: NaN, or a random integer for integer outputs
    (a different one every run, so an output left over from an earlier run is caught too)."""
    kind = out.dtype.kind
    if kind in "fc":
        out.fill(float("nan"))
    elif kind in "iu":
        import numpy as np

        info = np.iinfo(out.dtype)
        out.fill(int(rng.integers(max(info.min, -2**31), min(info.max, 2**31 - 1))))
    elif kind == "b":
        out.fill(bool(rng.integers(2)))
    else:
        raise runtime.CourseInputError(f"the output of a performance test must be a number array, not {out.dtype}")


def _fingerprint(clock, args: tuple, out_index: int) -> bytes | None:
    """A few evenly spaced elements of every input array: equal fingerprints mean repeated inputs (None when
    there is no input array to compare)."""
    parts = []
    for i, a in enumerate(args):
        if i == out_index % len(args):
            continue
        if hasattr(a, "ravel") and hasattr(a, "size") and a.size:
            step = max(1, a.size // 64)
            parts.append(clock.sample(a.ravel()[::step][:64]).tobytes())
    return b"|".join(parts) if parts else None


def _measure(candidate: Callable, reference: Callable, *, make_inputs: Callable, check: Callable, clock,
             repeats: int, warmup: int, out_index: int = -1, names=("your code", "the reference")) -> dict:
    """Time candidate and reference alternately in this process; every run gets fresh inputs from
    ``make_inputs`` (refused if they repeat), its output poisoned before and checked right after.

    Returns {"candidate": [ms...], "reference": [ms...], "hopeless": bool}. Raises _WrongOutput for a
    wrong result (the message says whose), _Tampered if the clock's functions were replaced, and
    CourseError when make_inputs repeats itself."""
    import numpy as np

    rng = np.random.default_rng()
    state = {"fingerprint": None, "runs": 0}

    def run(fn: Callable, who: str) -> float:
        args = make_inputs()
        args = args if isinstance(args, tuple) else (args,)
        fingerprint = _fingerprint(clock, args, out_index)
        if fingerprint is not None and fingerprint == state["fingerprint"]:
            raise runtime.CourseError("make_inputs gave the same inputs twice in a row; the timing harness needs "
                                      "fresh random inputs for every run (a cache could otherwise answer)")
        state["fingerprint"] = fingerprint
        _poison(args[out_index], rng)
        ms = clock.time(fn, args)
        state["runs"] += 1
        try:
            ok = check(*args)
            why = "" if ok or ok is None else "the check failed"
        except AssertionError as exc:
            why = str(exc) or "the check failed"
        except Exception as exc:  # noqa: BLE001 - an output the check cannot even read is wrong too
            why = f"{type(exc).__name__}: {exc}"
        if why:
            raise _WrongOutput(f"{who} gave a wrong result on run {state['runs']} ({first_lines(why, 1, 200)})")
        return ms

    times = {"candidate": [], "reference": [], "hopeless": False}
    for _ in range(warmup):
        run(reference, names[1])
        run(candidate, names[0])
    probe_ref, probe = run(reference, names[1]), run(candidate, names[0])
    if probe > 2 * ZERO_AT * probe_ref:  # no points either way: do not spend the repeats
        times.update(candidate=[probe], reference=[probe_ref], hopeless=True)
    else:
        for _ in range(repeats):
            times["reference"].append(run(reference, names[1]))
            times["candidate"].append(run(candidate, names[0]))
    clock.verify()
    return times


def gpus_missing(needed: int, max_points: float) -> bool:
    """On a GPU machine with fewer than ``needed`` GPUs, print the line that makes a ``perf_`` test "not gradable
    here (needs more GPUs)" (0 points, left out of the gradable total) and return True; otherwise False. A
    multi-GPU test cell starts with ``if not grading.gpus_missing(2, points): ...``. In CPU mode every perf_
    test is not gradable anyway, and this returns False."""
    if not runtime.is_gpu():
        return False
    have = runtime.cupy().cuda.runtime.getDeviceCount()
    if have >= needed:
        return False
    print(GPUS_PERF_MESSAGE.format(needed=needed, have=have, points=number(max_points)))
    return True


def needs_gpus(needed: int, max_points: float) -> bool:
    """For a test of results (not a ``perf_`` test) that only a machine with ``needed`` GPUs can check: with fewer
    (CPU mode has none), print the line that makes it "not gradable here (needs more GPUs)" (0 points, left out of
    the gradable total) and return True; otherwise False. The test cell starts with ``if not
    grading.needs_gpus(2, points): ...``; the verdict believes the line only in a test whose own source calls this
    function."""
    have = runtime.gpu_count()
    if have >= needed:
        return False
    print(GPUS_MESSAGE.format(needed=needed, have=have, points=number(max_points)))
    return True


def step_missing(step: str | None, max_points: float, cc=None) -> bool:
    """Where this GPU (or a GPU of compute capability ``cc``) cannot run lesson step ``step`` (a key of
    gpucourse.gpus.STEPS), print the line that makes a ``perf_`` test "not gradable here (needs a newer GPU)"
    (0 points, left out of the gradable total) and return True; otherwise False. ``performance_points(...,
    step=...)`` asks this before it times anything."""
    if step is None or (cc is None and runtime.compute_capability() is None):
        return False  # no GPU to ask about: performance_points says so itself (CPU mode)
    st = gpus.status(step, cc)
    if st.runs:
        return False
    print(STEP_PERF_MESSAGE.format(why=st.line(), points=number(max_points)))
    return True


def software_missing(why: str | None, max_points: float) -> bool:
    """Where a test needs software this machine lacks (``why``: one line saying what, e.g. from
    ``kernels.attention.triton_kernels.available()``; None where all is there), print the line that makes the test
    "not gradable here (needs software this machine lacks)" (0 points, left out of the gradable total) and return
    True; otherwise False. Any test cell, not only a ``perf_`` one, starts with ``if not grading.software_missing(why,
    points): ...``; the verdict believes the line only in a test whose own source calls this function."""
    if why is None:
        return False
    print(SOFTWARE_MESSAGE.format(why=" ".join(str(why).split()), points=number(max_points)))
    return True


def performance_points(candidate: Callable, reference: Callable, *, make_inputs: Callable, check: Callable,
                       max_points: float, repeats: int = 20, warmup: int = 3, out_index: int = -1,
                       gpus: int = 1, step: str | None = None) -> float:
    """Time ``candidate`` against ``reference`` on a GPU and return the points earned, as a Python float.

    Both are called as f(*make_inputs()), alternately, ``warmup`` times each untimed and ``repeats`` times
    each timed, in this one process (``_measure``). Every run gets fresh inputs from make_inputs (untimed;
    inputs that repeat are refused), the output argument (``out_index``) poisoned first (NaN, or a random
    integer) and checked with ``check(*args)`` right after (True, None or no AssertionError means right).
    Each run is timed between CUDA events around a device-wide synchronisation (``_CudaClock``), so work
    left on another stream counts. A wrong result on any run scores 0; so does a notebook that replaced
    the CUDA timing functions. Otherwise r = median candidate time / median reference time scores as
    ``performance_score``.

    gpus: the GPUs the test needs; with fewer, the test is "not gradable here (needs more GPUs)" (``gpus_missing``).
    step: the lesson step (gpucourse.gpus.STEPS) the candidate runs; on a GPU that cannot run it, the test is
    "not gradable here (needs a newer GPU)" (``step_missing``), and nothing is timed.

    Prints one line that starts with "performance:". In CPU mode nothing is timed: the line says the points
    cannot be graded here and 0 is returned. Use it as the last expression of a ``perf_`` test cell whose
    points equal ``max_points``: nbgrader takes the cell's value as its score.
    """
    if repeats < 1 or warmup < 0 or max_points < 0:
        raise runtime.CourseInputError("repeats must be at least 1, warmup and max_points at least 0")
    if not runtime.is_gpu():
        print(CPU_PERF_MESSAGE.format(points=number(max_points)))
        return 0.0
    if gpus_missing(gpus, max_points) or step_missing(step, max_points):
        return 0.0

    name = getattr(candidate, "__name__", "your code")
    ref_name = getattr(reference, "__module__", "") + "." + getattr(reference, "__name__", "reference")
    try:
        clock = _CudaClock(runtime.cupy())
        times = _measure(candidate, reference, make_inputs=make_inputs, check=check, clock=clock, repeats=repeats,
                         warmup=warmup, out_index=out_index, names=(name, f"the reference {ref_name}"))
    except _Tampered as exc:
        print(f"performance: {exc}; 0 of {number(max_points)} points")
        return 0.0
    except _WrongOutput as exc:
        if str(exc).startswith("the reference"):
            raise runtime.CourseError(f"{exc}: the test's inputs or check are wrong, not your code") from None
        print(f"performance: {exc}; 0 of {number(max_points)} points")
        return 0.0
    from .. import bench

    import statistics

    t_cand, t_ref = statistics.median(times["candidate"]), statistics.median(times["reference"])
    ratio = t_cand / t_ref
    points = performance_score(ratio, max_points)
    runs = (f"timed once: over {number(2 * ZERO_AT)}x slower, not repeated" if times["hopeless"]
            else f"medians of {repeats} runs each, alternating")
    print(f"performance: {name} {bench.format_ms(t_cand)} vs reference {bench.format_ms(t_ref)} ({runs}):\n"
          f"  ratio {ratio:.2f} -> {number(points)} of {number(max_points)} points "
          f"(all at <= {FULL_AT}, none at >= {number(ZERO_AT)})")
    return float(points)
