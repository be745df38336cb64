"""Lesson 1's measurements on a GPU, and the figures drawn from them (measured or recorded).

Every function that measures needs GPU mode; every plot function takes the figures plus their source
label, so the notebook draws recorded figures in CPU mode with the same code.
"""
from __future__ import annotations

import math
import time

import numpy as np

from gpucourse.records import Figure
from gpucourse import bench, claims, plots, runtime
from kernels import vector_multiply as vm

LESSON = "01_vector_multiply"
FLOP_PER_ELEMENT = 1
BYTES_PER_ELEMENT = 3 * 4  # float32: read a, read b, write out
# The kernel table and the numba sweep queue each launch behind a 1 ms hold kernel (bench.hold), so that the
# events time the kernel and not the host's launch work (a numba launch with six arrays takes tens of µs).
HOLD_MS = 1.0


def _inputs(n: int):
    """Random a, b and a NaN-poisoned out on the GPU, as CuPy arrays."""
    cp = runtime.cupy()
    runtime.check_fits(3 * n * 4 + n * 4, f"vector multiply of {n:,} float32 elements")
    a = cp.random.random(n, dtype=cp.float32)
    b = cp.random.random(n, dtype=cp.float32)
    return a, b, cp.full(n, cp.nan, dtype=cp.float32)


def _operands(n: int) -> tuple:
    """(a, b, out) as CuPy arrays followed by the same three wrapped once for numba."""
    cupy_arrays = _inputs(n)
    return cupy_arrays + tuple(runtime.cuda().as_cuda_array(x) for x in cupy_arrays)


# name -> (kind, launch on the operands of _operands) for every way the course multiplies two vectors
LAUNCHERS = {
    "numba, one thread per element": ("kernel", lambda a, b, o, na, nb, no: vm.multiply(na, nb, no, kernel="one_per_thread")),
    "numba, grid-stride": ("kernel", lambda a, b, o, na, nb, no: vm.multiply(na, nb, no, kernel="grid_stride")),
    "numba, grid-stride, 4 in flight": ("kernel", lambda a, b, o, na, nb, no: vm.multiply(na, nb, no,
                                                                                         kernel="grid_stride_x4")),
    "numba, grid-stride, pairs (two adjacent elements a thread)": ("kernel", lambda a, b, o, na, nb, no: vm.multiply(
        na, nb, no, kernel="pairs")),
    "CUDA C, grid-stride": ("kernel", lambda a, b, o, *_: vm.multiply_cuda_c(a, b, o, variant="vmul_grid_stride")),
    "CUDA C, float4": ("kernel", lambda a, b, o, *_: vm.multiply_cuda_c(a, b, o, variant="vmul_vec4")),
    "CUDA C, float4 x4 unrolled": ("kernel", lambda a, b, o, *_: vm.multiply_cuda_c(a, b, o, variant="vmul_vec4_unroll4")),
    "cupy.multiply": ("library", lambda a, b, o, *_: vm.multiply_library(a, b, o)),
}


def kernel_table(n: int | None = None, repeats: int = 20) -> dict:
    """Every kernel and cupy.multiply on two n-element float32 vectors, beside a device-to-device copy of
    the same size measured in the same run. Each result is checked against a * b."""
    cp = runtime.cupy()
    n = n or runtime.size("vector_multiply.n")
    operands = _operands(n)
    a, b, out = operands[:3]
    expected = a * b
    rows = []
    for name, (kind, launch) in bench.progress(LAUNCHERS.items(), desc="kernels"):
        out.fill(cp.nan)
        t = bench.time_gpu(lambda: launch(*operands), repeats=repeats, hold_ms=HOLD_MS)
        if not bool(cp.array_equal(out, expected)):
            raise runtime.CourseError(f"{name} gave a wrong result; not timing it")
        rows.append({"name": name, "kind": kind, **t.summary(), "gbps": t.gbps(BYTES_PER_ELEMENT * n)})
    del expected
    t = bench.time_gpu(lambda: out.data.copy_from_device_async(a.data, a.nbytes), repeats=repeats, hold_ms=HOLD_MS)
    copy = t.gbps(2 * a.nbytes)
    rows.append({"name": "device-to-device copy", "kind": "ceiling", **t.summary(), "gbps": copy})
    library = next(r["gbps"] for r in rows if r["kind"] == "library")
    for r in rows:
        r["of_copy"] = r["gbps"] / copy
        r["of_library"] = r["gbps"] / library
    return {"n": n, "bytes": BYTES_PER_ELEMENT * n, "copy_gbps": copy, "rows": rows}


def grid_sweep(n: int | None = None, repeats: int = 20) -> dict:
    """GB/s of the CUDA C grid-stride kernels against the number of blocks launched: a grid-stride loop
    lets you choose the grid, and the best choice differs between scalar and float4 loads."""
    n = n or runtime.size("vector_multiply.n")
    a, b, out = _inputs(n)
    sms = runtime.get().device["sms"]
    per_sm = [1, 2, 4, 8, 16, 32, 64]
    series = {}
    for variant in bench.progress(("vmul_grid_stride", "vmul_vec4"), desc="grids"):
        full = math.ceil(n / (256 * vm.ELEMENTS_PER_THREAD[variant]))
        blocks = [k * sms for k in per_sm if k * sms < full] + [full]
        series[variant] = {"blocks": blocks, "gbps": [
            bench.time_gpu(lambda: vm.multiply_cuda_c(a, b, out, variant=variant, blocks=g), repeats=repeats)
            .gbps(BYTES_PER_ELEMENT * n) for g in blocks]}
    return {"n": n, "sms": sms, "threads": 256, "series": series}


def numba_sweep(n: int | None = None, repeats: int = 20) -> dict:
    """What holds the numba grid-stride kernel below the copy: GB/s of the three numba grid-stride kernels
    (one element a trip; four elements a grid apart in flight; two adjacent elements) against blocks per
    SM, for 256 and 1024 threads a block."""
    cuda = runtime.cuda()
    n = n or runtime.size("vector_multiply.n")
    na, nb, nout = (cuda.as_cuda_array(x) for x in _inputs(n))
    sms = runtime.get().device["sms"]
    per_sm = [1, 2, 4, 8, 32]
    series = {}
    for kernel in bench.progress(("grid_stride", "grid_stride_x4", "pairs"), desc="numba grids"):
        for threads in (256, 1024):
            series[f"{kernel}, {threads} threads"] = {"per_sm": per_sm, "gbps": [
                bench.time_gpu(lambda: vm.multiply(na, nb, nout, kernel=kernel, threads=threads, blocks=k * sms),
                               repeats=repeats, hold_ms=HOLD_MS).gbps(BYTES_PER_ELEMENT * n) for k in per_sm]}
    return {"n": n, "sms": sms, "series": series}


def transfer_table(n: int | None = None) -> dict:
    """Host -> device copies of the two input vectors from pageable and from pinned host memory, the result
    back, and the kernel itself: where the time of the whole job goes."""
    import cupyx

    cp = runtime.cupy()
    n = n or runtime.size("vector_multiply.n")
    runtime.check_fits(3 * n * 4, "the transfer measurement")
    rng = np.random.default_rng(1)
    pageable = [rng.random(n, dtype=np.float32) for _ in range(3)]
    pinned = [cupyx.empty_pinned(n, dtype=np.float32) for _ in range(3)]
    pinned[0][:], pinned[1][:] = pageable[0], pageable[1]
    a, b, out = (cp.empty(n, dtype=cp.float32) for _ in range(3))
    na, nb, nout = (runtime.cuda().as_cuda_array(x) for x in (a, b, out))
    steps = {  # name: (work, bytes moved, warm-up runs, timed runs)
        "a, b host->device, pageable": (lambda: (a.set(pageable[0]), b.set(pageable[1])), 2 * n * 4, 1, 3),
        "a, b host->device, pinned": (lambda: (a.set(pinned[0]), b.set(pinned[1])), 2 * n * 4, 1, 5),
        "kernel (numba grid-stride)": (lambda: vm.multiply(na, nb, nout), 3 * n * 4, 3, 20),
        "out device->host, pageable": (lambda: out.get(out=pageable[2]), n * 4, 1, 3),
        "out device->host, pinned": (lambda: out.get(out=pinned[2]), n * 4, 1, 5),
    }
    rows = []
    for name, (work, nbytes, warmup, repeats) in bench.progress(steps.items(), desc="transfers"):
        t = bench.time_gpu(work, warmup=warmup, repeats=repeats)
        rows.append({"name": name, **t.summary(), "gbps": t.gbps(nbytes)})
    if not np.array_equal(pinned[2], pinned[0] * pinned[1]):
        raise runtime.CourseError("the vector multiply after the transfers gave a wrong result")
    return {"n": n, "rows": rows}


def launch_timing(n: int | None = None) -> dict:
    """The engineer's notes' "the multiply took only 80 µs" (docs/sources.md): a host timer around an asynchronous launch, against the
    same timer with a synchronise, against CUDA events."""
    cp = runtime.cupy()
    cuda = runtime.cuda()
    n = n or runtime.size("vector_multiply.n")
    a, b, out = (cuda.as_cuda_array(x) for x in _inputs(n))

    def launch():
        vm.multiply(a, b, out)

    no_sync = bench.wall_clock(launch, synchronize=False, repeats=10)
    with_sync = bench.wall_clock(launch, synchronize=True, repeats=10)
    events = bench.time_gpu(launch, repeats=10)
    cp.cuda.Device().synchronize()
    return {"n": n, "wall_no_sync_ms": no_sync.median_ms, "wall_sync_ms": with_sync.median_ms,
            "events_ms": events.median_ms}


def utilisation(seconds: float = 3.0) -> dict:
    """What NVML (and so nvidia-smi) calls utilisation while ONE block of 32 threads spins on one SM, against
    the same kernel on every SM; beside it, the work each really did."""
    import pynvml

    cp = runtime.cupy()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(cp.cuda.Device().id)
    sms = runtime.get().device["sms"]

    def median_utilisation(during: float) -> float:
        samples, end = [], time.perf_counter() + during
        time.sleep(0.5)  # NVML averages over its own sample period: skip the start
        while time.perf_counter() < end:
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            time.sleep(0.1)
        return float(np.median(samples))

    cp.cuda.Device().synchronize()
    time.sleep(1.0)
    result = {"idle_pct": median_utilisation(1.5), "sms": sms, "seconds": seconds}
    for label, blocks in (("one_block", 1), ("every_sm", 8 * sms)):
        rounds = vm.spin(seconds, blocks=blocks)  # asynchronous: sample while it runs
        result[f"{label}_pct"] = median_utilisation(seconds - 0.3)
        cp.cuda.Device().synchronize()
        result[f"{label}_gflop"] = float(rounds.sum()) * 1000 * 2 / 1e9  # a multiply-add is 2 FLOPs
        result[f"{label}_blocks"] = blocks
    result["work_ratio"] = result["every_sm_gflop"] / result["one_block_gflop"]
    return result


def size_sweep(repeats: int = 20) -> dict:
    """GB/s against vector length: small launches are dominated by fixed costs, large ones by bandwidth.
    Small vectors would sit in the L2 cache between repeats, so every repeat gets inputs not yet cached."""
    cp = runtime.cupy()
    sizes = list(runtime.size("vector_multiply.sweep"))
    series = {"CUDA C, float4": [], "numba, grid-stride": [], "cupy.multiply": []}
    for n in bench.progress(sizes, desc="sizes"):
        fresh = bench.rotating_inputs(lambda: _operands(n), BYTES_PER_ELEMENT * n)
        for name in series:
            t = bench.time_gpu(LAUNCHERS[name][1], setup=fresh, repeats=repeats)
            series[name].append(t.gbps(BYTES_PER_ELEMENT * n))
        del fresh
        cp.get_default_memory_pool().free_all_blocks()
    return {"sizes": sizes, "gbps": series}


def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    measure = {"kernels": kernel_table, "grids": grid_sweep, "numba": numba_sweep, "transfers": transfer_table,
               "launch": launch_timing,
               "utilisation": utilisation, "sweep": size_sweep}
    return {key: measure[key]() for key in FIGURES}, ceilings


# ------------------------------------------------------------------------------------- figures

def plot_kernels(table: dict, source: str):
    values = {r["name"]: r["gbps"] for r in table["rows"] if r["kind"] != "ceiling"}
    return plots.bars(values, unit="GB/s", source=source, ceiling=("device-to-device copy", table["copy_gbps"]),
                      title=f"Vector multiply, 2 x {table['n'] * 4 / 2**30:.0f} GiB float32 (bytes read + written)")


def plot_grids(grids: dict, source: str, copy_gbps: float):
    series = {variant: ([g / grids["sms"] for g in v["blocks"]], v["gbps"]) for variant, v in grids["series"].items()}
    return plots.lines(series, levels={"device-to-device copy, GB/s": copy_gbps}, logy=False, source=source,
                       xlabel=f"blocks per SM ({grids['threads']} threads each); the last point covers every element once",
                       ylabel="GB/s", title="Choosing the grid")


def plot_numba(sweep: dict, source: str, copy_gbps: float):
    series = {name: (v["per_sm"], v["gbps"]) for name, v in sweep["series"].items()}
    return plots.lines(series, levels={"device-to-device copy, GB/s": copy_gbps}, logy=False, source=source,
                       xlabel="blocks per SM", ylabel="GB/s",
                       title="The numba grid-stride kernel: grid size, loads in flight, access width")


def plot_transfers(table: dict, source: str):
    values = {r["name"]: r["median_ms"] for r in table["rows"]}
    return plots.bars(values, unit="ms", source=source, title="Where the time goes: copies vs the kernel")


def plot_sweep(sweep: dict, copy_gbps: float, source: str):
    series = {name: (sweep["sizes"], gbps) for name, gbps in sweep["gbps"].items()}
    return plots.lines(series, levels={"device-to-device copy (2 GiB), GB/s": copy_gbps}, source=source,
                       xlabel="elements per vector", ylabel="GB/s", title="Achieved bandwidth against vector length")


def plot_roofline(table: dict, ceilings: dict, source: str):
    intensity = FLOP_PER_ELEMENT / BYTES_PER_ELEMENT
    points = {r["name"]: (intensity, r["gbps"] * intensity / 1e3) for r in table["rows"]
              if r["name"] in ("numba, grid-stride", "cupy.multiply", "CUDA C, float4")}
    return plots.roofline(bandwidth_gbps=ceilings["copy_gbps"], source=source, points=points,
                          peaks_tflops={"FP32 (cuBLAS)": ceilings["fp32_tflops"],
                                        "FP16 tensor cores (cuBLAS)": ceilings["fp16_tflops"]},
                          title="Vector multiply on the roofline")


def kernels_table(table: dict, source: str):
    """The kernel table for a notebook (plots.table: HTML there, aligned text elsewhere): time, GB/s, and the
    fractions of the copy and of cupy.multiply."""
    rows = [(r["name"], bench.format_ms(r["median_ms"]), round(r["gbps"]), f"{r['of_copy']:.2f}",
             f"{r['of_library']:.2f}") for r in table["rows"]]
    return plots.table(["kernel", "median", "GB/s", "of copy", "of cupy"], rows, source=source,
                       title=f"Vector multiply, 2 x {table['n'] * 4 / 2**30:.0f} GiB float32 (bytes read + written); "
                             "every result checked equal to a * b")


def reading(table: dict) -> list:
    """What notebook 01 says about its kernel table (``table``: a run's or a record's figure "kernels"), each
    statement with whether it holds: [(statement, True, False or None)]. The words come from the relation each
    tests (gpucourse.claims.compare); a records test asserts every statement on every record."""
    rows = {r["name"]: r for r in table["rows"]}

    def of_copy(name):
        return lambda: rows[name]["of_copy"]

    def gbps(name):
        return lambda: rows[name]["gbps"]

    return [
        claims.compare("cupy.multiply", "below", "the copy's GB/s", of_copy("cupy.multiply"), 1.0, 0.05),
        claims.compare("numba, grid-stride", "below", "the copy's GB/s", of_copy("numba, grid-stride"), 1.0, 0.05),
        claims.compare("CUDA C, float4", "level with", "the copy's GB/s", of_copy("CUDA C, float4"), 1.0, 0.05),
        claims.compare("CUDA C, float4", "above", "CUDA C, grid-stride (scalar loads)", gbps("CUDA C, float4"),
                       gbps("CUDA C, grid-stride"), 0.02),
        claims.compare("CUDA C, float4 x4 unrolled (four loads in flight)", "no faster than", "CUDA C, float4",
                       gbps("CUDA C, float4 x4 unrolled"), gbps("CUDA C, float4"), 0.02),
    ]


def grid_reading(grids: dict) -> list:
    """What notebook 01 says about the grid sweep (``grids``: the figure "grids"): the fastest grid of the scalar
    kernel is smaller than the float4 kernel's."""
    def best(variant):
        return lambda: grids["series"][variant]["blocks"][int(np.argmax(grids["series"][variant]["gbps"]))]
    return [claims.compare("fastest grid of the scalar kernel (blocks)", "below", "the float4 kernel's",
                           best("vmul_grid_stride"), best("vmul_vec4"))]


def sweep_reading(sweep: dict) -> list:
    """What notebook 01 says about the size sweep (``sweep``: the figure "sweep"): at the smallest size every
    kernel reaches under a tenth of its best GB/s, and numba's kernel less than cupy.multiply."""
    n, gbps = sweep["sizes"][0], sweep["gbps"]
    read = [claims.compare(f"{name} at {n:,} elements (GB/s)", "below", "a tenth of its best",
                           lambda name=name: gbps[name][0], lambda name=name: 0.1 * max(gbps[name]))
            for name in gbps]
    read.append(claims.compare(f"numba, grid-stride at {n:,} elements (GB/s)", "below", "cupy.multiply's",
                               lambda: gbps["numba, grid-stride"][0], lambda: gbps["cupy.multiply"][0]))
    return read


def transfer_reading(transfers: dict) -> list:
    """What notebook 01, section 6, says about the copies (``transfers``: a run's or a record's figure
    "transfers"): pinned copies more than twice as fast as pageable ones, each way; even pinned, under a tenth of
    the kernel's GB/s. [(statement, holds)], the words from the relation each tests."""
    rows = {r["name"]: r for r in transfers["rows"]}

    def gbps(name, times=1.0):
        return lambda: times * rows[name]["gbps"]

    read = []
    for way in ("a, b host->device", "out device->host"):
        read.append(claims.compare(f"{way}, pinned over pageable (GB/s)", "above", "2x",
                                   lambda way=way: rows[f"{way}, pinned"]["gbps"] / rows[f"{way}, pageable"]["gbps"],
                                   2.0))
    for way in ("a, b host->device", "out device->host"):
        read.append(claims.compare(f"{way}, pinned (GB/s)", "below", "a tenth of the kernel's GB/s",
                                   gbps(f"{way}, pinned"), gbps("kernel (numba grid-stride)", 0.1)))
    return read


def launch_reading(launch: dict) -> list:
    """What notebook 01, section 7, says about the three timers (``launch``: the figure "launch"): the host timer
    without a synchronise reads under half the kernel's time on the GPU's clock; synchronised, it reads the
    kernel's time (within 10%)."""
    return [
        claims.compare("host timer, no synchronise", "below", "half the CUDA events' time",
                       lambda: launch["wall_no_sync_ms"], lambda: 0.5 * launch["events_ms"]),
        claims.compare("host timer, synchronised", "level with", "the CUDA events' time",
                       lambda: launch["wall_sync_ms"], lambda: launch["events_ms"], 0.1),
    ]


def utilisation_reading(util: dict) -> list:
    """What notebook 01, section 9, says about nvidia-smi's utilisation (``util``: the figure "utilisation"): one
    block and blocks on every SM read the same (within 10%) for more than ten times the work; the idle GPU reads
    under 5 %."""
    return [
        claims.compare("utilisation, one block of 32 threads", "level with", "blocks on every SM",
                       lambda: util["one_block_pct"], lambda: util["every_sm_pct"], 0.1),
        claims.compare("GFLOP done, blocks on every SM", "above", "10x one block's",
                       lambda: util["every_sm_gflop"], lambda: 10 * util["one_block_gflop"]),
        claims.compare("utilisation of the idle GPU", "below", "5 %", lambda: util["idle_pct"], 5.0),
    ]


def reading_view(table: dict, source: str) -> plots.Table:
    """The statements of ``reading`` on the kernel table shown, labelled with its source."""
    return claims.view({"holds": reading(table)}, title="What the table says, checked", source=source)


def table_text(table: dict) -> str:
    """The kernel table as aligned text."""
    lines = [f"{'':32} {'median':>10} {'GB/s':>8} {'of copy':>8} {'of cupy':>8}"]
    for r in table["rows"]:
        lines.append(f"{r['name']:32} {bench.format_ms(r['median_ms']):>10} {r['gbps']:8.0f} "
                     f"{r['of_copy']:8.2f} {r['of_library']:8.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the registry

FIGURES = {  # what run() records, in this order; the notebook draws them with the plot functions above
    "kernels": Figure(kernel_table, plot_kernels, table_text),
    "grids": Figure(grid_sweep),
    "numba": Figure(numba_sweep),
    "transfers": Figure(transfer_table, plot_transfers),
    "launch": Figure(launch_timing),
    "utilisation": Figure(utilisation),
    "sweep": Figure(size_sweep),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline."""
    from gpucourse import results as R

    k = record["figures"].get("kernels", {})
    rows = k.get("rows", [])
    numba = max((r for r in rows if r["name"].startswith("numba")), key=lambda r: r["gbps"], default=None)
    cuda_c = max((r for r in rows if r["name"].startswith("CUDA C")), key=lambda r: r["gbps"], default=None)
    cupy = next((r for r in rows if r["kind"] == "library"), None)
    pinned = next((r for r in record["figures"].get("transfers", {}).get("rows", [])
                   if r["name"].endswith("host->device, pinned")), None)
    return [
        ("fastest numba multiply, share of the copy's GB/s", R.share(numba and numba["of_copy"]), "kernels"),
        ("device-to-device copy, GB/s", R.number(k.get("copy_gbps")), "kernels"),
        ("fastest numba multiply, GB/s", R.number(numba and numba["gbps"]), "kernels"),
        ("fastest CUDA C multiply, share of the copy's GB/s", R.share(cuda_c and cuda_c["of_copy"]), "kernels"),
        ("cupy.multiply, share of the copy's GB/s", R.share(cupy and cupy["of_copy"]), "kernels"),
        ("pinned host-to-device copy, GB/s", R.number(pinned and pinned["gbps"]), "transfers"),
    ]
