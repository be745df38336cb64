"""Lesson 3's measurements on a GPU, and the figures drawn from them (measured or recorded).

Every function that measures needs GPU mode and checks each kernel's result before timing it (into an output
poisoned with NaN first); every plot function takes the figures plus their source label, so the notebook draws
recorded figures in CPU mode with the same code. The model the measurements are set against is in
kernels/memory_model.py, the kernels in kernels/memory.py and kernels/cuda/memory.cu.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from gpucourse import bench, claims, plots, records, runtime
from gpucourse.claims import holds
from gpucourse.records import Figure
from kernels import memory as mem
from kernels import memory_model as mm

LESSON = "03_memory"
LEVELS = ("registers", "shared memory", "L1", "L2", "HBM")
BLOCKS = ((16, 16), (32, 8), (8, 32))
SECTOR_METRICS = {
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "global load requests (warp instructions)",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "global load sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": "global store requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": "global store sectors",
    "smsp__sass_inst_executed_op_shared_ld.sum": "shared load instructions",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "shared load wavefronts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "shared load bank conflicts",
}


def _sm_count() -> int:
    return runtime.get().device["sms"]


def _copy_gbps() -> float:
    return bench.ceilings().copy_gbps


# ---------------------------------------------------------------------------------------- the hierarchy

def hierarchy(repeats: int = 5) -> dict:
    """Latency and bandwidth of each level, measured here. Latency: one thread's chase of dependent loads through a
    random cycle (shared memory; global memory in a working set of 8 KiB for the L1, 4 MiB for the L2, 1 GiB for
    HBM), and a chain of dependent FMAs for the registers; cycles from clock64(), nanoseconds at the SM clock
    measured meanwhile. Bandwidth: the read probe of kernels/cuda/memory.cu with slices that fit each level, the
    shared-memory read probe, and the device-to-device copy (this GPU's copy ceiling)."""
    cp = runtime.cupy()
    sms = _sm_count()
    ghz = mem.clock_ghz()
    chases = {  # level: (nodes, spacing in words, warm, steps)
        "L1": (64, 32, 4 * 64, 4096),  # 8 KiB, 128-byte nodes
        "L2": (32768, 32, 32768, 8192),  # 4 MiB
        "HBM": (2**21, 128, 256, 8192),  # 1 GiB, 512-byte nodes
    }
    cycles = {"registers": mem.fma_chain(8192)}
    chain = mem.chase_chain(1024, 1, xp=cp)
    cycles["shared memory"] = min(mem.chase(chain, steps=8192, shared=True) for _ in range(repeats))
    for level, (nodes, spacing, warm, steps) in bench.progress(chases.items(), desc="pointer chase"):
        chain = mem.chase_chain(nodes, spacing, xp=cp, seed=1)
        if level == "HBM":  # each run walks on into nodes no run has touched: none is in a cache
            cycles[level] = min(mem.chase(chain, steps=steps, warm=warm + r * (warm + steps)) for r in range(3))
        else:  # each run walks the whole chain into the cache first
            cycles[level] = min(mem.chase(chain, steps=steps, warm=warm) for _ in range(3))
        del chain
    latency = {level: {"cycles": cycles[level], "ns": cycles[level] / ghz} for level in LEVELS}

    l2 = int(runtime.get().device["l2_mib"] * 2**20)
    blocks = 8 * sms  # 8 x 256 threads: a full SM (2,048 threads), every SM
    hbm_bytes = 2**30
    x = cp.random.random(hbm_bytes // 4, dtype=cp.float32)
    sink = cp.zeros(1, dtype=cp.float32)
    probes = {  # level: (slice of float4 per block, reps, shift)
        "L1": (1024, 2000, 0),  # 16 KiB a block, eight blocks an SM: 128 KiB an SM, reread
        "L2": (l2 // 4 // 16 // blocks, 400, 1),  # a quarter of the L2 in all, passed from block to block
        "HBM": (hbm_bytes // 16 // blocks, 1, 0),  # 1 GiB, read once
    }
    bandwidth = {}
    for level, (slice_vec, reps, shift) in bench.progress(probes.items(), desc="read probes"):
        nbytes = blocks * slice_vec * 16 * reps
        t = bench.time_per_call(lambda: mem.read_level(x, slice_vec=slice_vec, reps=reps, shift=shift, blocks=blocks,
                                                        sink=sink), batch=2, repeats=repeats)
        bandwidth[level] = {"gbps": t.gbps(nbytes), "bytes": nbytes, "working_set": blocks * slice_vec * 16,
                            **t.summary()}
    shared_blocks, reps = 8 * sms, 4096
    nbytes = shared_blocks * 256 * reps * 16
    t = bench.time_per_call(lambda: mem.shared_read(reps=reps, blocks=shared_blocks, sink=sink), batch=2,
                            repeats=repeats)
    bandwidth["shared memory"] = {"gbps": t.gbps(nbytes), "bytes": nbytes, **t.summary()}
    if float(sink.get()[0]) != 0.0:
        raise runtime.CourseError("a bandwidth probe wrote its sink: its sums were not what they must be")
    del x
    copy = _copy_gbps()
    return {"clock_ghz": ghz, "sms": sms, "l2_mib": runtime.get().device["l2_mib"], "levels": list(LEVELS),
            "latency": latency, "bandwidth": bandwidth, "copy_gbps": copy,
            "chases": {k: {"nodes": v[0], "spacing_bytes": 4 * v[1], "working_set": 4 * v[0] * v[1]}
                       for k, v in chases.items()}}


# ---------------------------------------------------------------------------------------------- coalescing

def _check_equal(got, want, what: str) -> None:
    cp = runtime.cupy()
    if not bool(cp.array_equal(got, want)):
        bad = int(cp.count_nonzero(got != want))
        raise runtime.CourseError(f"{what}: {bad} of {got.size} elements wrong; not timing it")


def stride_sweep(n: int | None = None, strides=None, repeats: int = 10) -> dict:
    """copy_strided (dst[i] = src[i * stride]) for n elements at each stride: the useful bandwidth (n read + n
    written), against the model's sectors per warp and its prediction at the copy ceiling."""
    cp, cuda = runtime.cupy(), runtime.cuda()
    n = n or runtime.size("memory.stride_n")
    strides = list(strides or runtime.size("memory.strides"))
    runtime.check_fits(4 * n * (max(strides) + 1), "the stride sweep")
    src = cp.random.random(n * max(strides), dtype=cp.float32)
    dst = cp.empty(n, dtype=cp.float32)
    nsrc, ndst = cuda.as_cuda_array(src), cuda.as_cuda_array(dst)
    copy = _copy_gbps()
    rows = []
    for s in bench.progress(strides, desc="strides"):
        dst.fill(cp.nan)
        mem.strided(nsrc, n, s, out=ndst)
        _check_equal(dst, src[: n * s : s], f"copy_strided at stride {s}")
        t = bench.time_per_call(lambda: mem.strided(nsrc, n, s, out=ndst), batch=4, repeats=repeats)
        model = mm.predict_strided_copy(n, s, copy)
        rows.append({"stride": s, "gbps": t.gbps(2 * 4 * n), "sectors": mm.stride_sectors(s),
                     "model_gbps": model["useful_gbps"], "model_ms": model["ms"], **t.summary()})
    return {"n": n, "useful_bytes": 8 * n, "copy_gbps": copy, "rows": rows}


def block_shapes(n: int | None = None, repeats: int = 10) -> dict:
    """scale_2d on an n x n float32 matrix with blocks of 16 x 16, 32 x 8 and 8 x 32 threads, x along the columns
    (coalesced) and along the rows (scale_2d_swapped): GB/s (read + write) and the model's sectors per warp."""
    cp, cuda = runtime.cupy(), runtime.cuda()
    n = n or runtime.size("memory.n")
    runtime.check_fits(2 * 4 * n * n, "the 2-D scale")
    a = cp.random.random((n, n), dtype=cp.float32)
    out = cp.empty_like(a)
    na, nout = cuda.as_cuda_array(a), cuda.as_cuda_array(out)
    want = cp.float32(2.0) * a
    rows = []
    for block in bench.progress(BLOCKS, desc="blocks"):
        for swapped in (False, True):
            what = f"{block[0]} x {block[1]}" + (", x along rows" if swapped else "")
            out.fill(cp.nan)
            mem.scale(na, 2.0, swapped=swapped, block=block, out=nout)
            _check_equal(out, want, f"scale, blocks {what}")
            t = bench.time_per_call(lambda: mem.scale(na, 2.0, swapped=swapped, block=block, out=nout), batch=4,
                                    repeats=repeats)
            rows.append({"block": list(block), "swapped": swapped, "name": what, "gbps": t.gbps(2 * a.nbytes),
                         "sectors_per_warp": mm.sectors(mm.block_warp(block, n, swapped=swapped)), **t.summary()})
    return {"n": n, "bytes": 2 * a.nbytes, "copy_gbps": _copy_gbps(), "rows": rows}


# ---------------------------------------------------------------------------------------------- shared memory

def transposes(n: int | None = None, repeats: int = 10) -> dict:
    """The three transposes of an n x n float32 matrix, each checked against a.T, timed, and set against the copy
    ceiling (a transpose reads and writes what a copy does) and the model's bytes moved and bank conflicts."""
    cp, cuda = runtime.cupy(), runtime.cuda()
    n = n or runtime.size("memory.n")
    runtime.check_fits(2 * 4 * n * n, "the transposes")
    a = cp.random.random((n, n), dtype=cp.float32)
    out = cp.empty_like(a)
    na, nout = cuda.as_cuda_array(a), cuda.as_cuda_array(out)
    want = cp.ascontiguousarray(a.T)
    copy = _copy_gbps()
    launches = {}
    for v in mem.VARIANTS:
        out.fill(cp.nan)
        mem.transpose(na, variant=v, out=nout)
        _check_equal(out, want, f"transpose ({v})")
        launches[v] = (lambda v=v: mem.transpose(na, variant=v, out=nout))
    timings = bench.interleaved(launches, rounds=3, repeats=max(2, repeats // 3), batch=4)
    rows = []
    for v in mem.VARIANTS:
        t = timings[v]
        model = mm.transpose_bytes(n, n, v)
        rows.append({"variant": v, "gbps": t.gbps(2 * a.nbytes), "of_copy": t.gbps(2 * a.nbytes) / copy,
                     "model_bytes": model["bytes_moved"], "model_ms": mm.predict_ms(model["bytes_moved"], copy),
                     "shared_ways": model["shared_ways"], **mm.transpose_costs(v, n), **t.summary()})
    return {"n": n, "bytes": 2 * a.nbytes, "copy_gbps": copy, "rows": rows}


def matmuls(n: int | None = None, repeats: int = 5, profiled: bool = True) -> dict:
    """matmul_naive and matmul_tiled (numba, FP32) on n x n matrices, checked against a float64 product, and
    cupy.matmul (cuBLAS SGEMM): TFLOP/s and the model's arithmetic intensity (bytes the kernel asks for, as if no
    cache helped), for the roofline; where Nsight Compute runs here (``profiled``), also the intensity against the
    bytes that really came from HBM."""
    cp, cuda = runtime.cupy(), runtime.cuda()
    n = n or runtime.size("memory.matmul_n")
    runtime.check_fits(3 * 4 * n * n + 3 * 8 * n * n, "the matrix multiplies")
    a = cp.random.random((n, n), dtype=cp.float32)
    b = cp.random.random((n, n), dtype=cp.float32)
    c = cp.empty((n, n), dtype=cp.float32)
    na, nb, nc = (cuda.as_cuda_array(m) for m in (a, b, c))
    want = a.astype(cp.float64) @ b.astype(cp.float64)
    scale = float(cp.abs(want).max())
    tol = mem.matmul_tolerance(n)
    launches = {"naive": lambda: mem.matmul(na, nb, variant="naive", out=nc),
                "tiled": lambda: mem.matmul(na, nb, variant="tiled", out=nc),
                "cuBLAS": lambda: cp.matmul(a, b, out=c)}
    errors = {}
    for name, launch in launches.items():
        c.fill(cp.nan)
        launch()
        err = float(cp.abs(c - want).max()) / scale
        if not err <= tol:
            raise runtime.CourseError(f"matmul ({name}): relative error {err:.2e} > {tol:.2e}; not timing it")
        errors[name] = err
    del want
    timings = bench.interleaved(launches, rounds=2, repeats=max(2, repeats // 2), batch=1)
    flops = 2 * n**3
    dram = matmul_dram_bytes(n) if profiled else {"available": False, "why": "not asked for"}
    rows = []
    for name in launches:
        traffic = mm.matmul_traffic(n, n, n, tile={"naive": None, "tiled": mem.MM_TILE}.get(name, None))
        if name == "cuBLAS":
            traffic = {"intensity": flops / (3 * 4 * n * n)}  # each matrix once: the most reuse there can be
        t = timings[name]
        row = {"name": name, "tflops": t.tflops(flops), "intensity": traffic["intensity"],
               "rel_error": errors[name], **t.summary()}
        if dram.get("available") and name in dram["bytes"]:
            row["dram_bytes"] = dram["bytes"][name]
            row["dram_intensity"] = flops / dram["bytes"][name]
        rows.append(row)
    return {"n": n, "flops": flops, "tile": mem.MM_TILE, "copy_gbps": _copy_gbps(),
            "fp32_tflops": bench.ceilings().fp32_tflops, "dram": {k: v for k, v in dram.items() if k != "bytes"},
            "rows": rows}


_DRAM_SNIPPET = r"""
import gpucourse
gpucourse.setup("gpu", quiet=True)
import cupy as cp
from numba import cuda
from kernels import memory as mem
n = {n}
a, b, c = (cuda.as_cuda_array(cp.random.random((n, n), dtype=cp.float32)) for _ in range(3))
for v in mem.MATMULS:
    mem.matmul(a, b, variant=v, out=c)
cuda.synchronize()
"""


def matmul_dram_bytes(n: int) -> dict:
    """Bytes read from and written to device memory (HBM) by each numba matmul at n, counted by Nsight Compute
    (dram__bytes_read.sum + dram__bytes_write.sum): what the caches did not serve. {"available", "bytes": {name:
    bytes}} or {"available": False, "why"}."""
    from gpucourse import profile

    metrics = {"dram__bytes_read.sum": "HBM bytes read", "dram__bytes_write.sum": "HBM bytes written"}
    try:
        got = profile.ncu(_DRAM_SNIPPET.format(n=n), metrics=metrics, kernel="matmul_", timeout=600)
    except profile.ProfilerUnavailable as exc:
        return {"available": False, "why": str(exc)}
    names = [v for v in mem.MATMULS]
    if len(got) != len(names) or not all(f"matmul_{v}" in r["kernel"] for v, r in zip(names, got)):
        return {"available": False, "why": f"ncu profiled {[r['kernel'][:40] for r in got]}, not {names}"}
    units = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}

    def count(r, k):
        return r[k] * units.get(r["units"].get(k, "byte"), 1)

    return {"available": True, "bytes": {v: count(r, "dram__bytes_read.sum") + count(r, "dram__bytes_write.sum")
                                         for v, r in zip(names, got)}}


# --------------------------------------------------------------------------------- the profiler and the sanitizer

_SECTORS_SNIPPET = r"""
import gpucourse
gpucourse.setup("gpu", quiet=True)
import cupy as cp
from numba import cuda
from kernels import memory as mem
n = {n}
src = cuda.as_cuda_array(cp.random.random(n * 32, dtype=cp.float32))
dst = cuda.as_cuda_array(cp.empty(n, dtype=cp.float32))
for s in {strides}:
    mem.strided(src, n, s, out=dst)
m = {m}
a = cuda.as_cuda_array(cp.random.random((m, m), dtype=cp.float32))
out = cuda.as_cuda_array(cp.empty((m, m), dtype=cp.float32))
for v in mem.VARIANTS:
    mem.transpose(a, variant=v, out=out)
for swapped in (False, True):
    mem.scale(a, 2.0, swapped=swapped, block=(32, 8), out=out)
cuda.synchronize()
"""


def sectors(n: int = 2**20, m: int = 2048, strides=(1, 2, 4, 8, 16, 32)) -> dict:
    """Nsight Compute's counts for the strided copies, the transposes and the 2-D scale (each launched once):
    sectors per global request and wavefronts per shared load, beside the model's. Where ncu cannot run here:
    {"available": False, "why": ...}."""
    from gpucourse import profile

    launches = [("copy_strided", f"stride {s}", mm.stride_sectors(s), None) for s in strides]
    launches += [(f"transpose_{v}", v, None, mm.transpose_costs(v, m)) for v in mem.VARIANTS]
    launches += [("scale_2d", "scale, x along columns", mm.sectors(mm.block_warp((32, 8), m)), None),
                 ("scale_2d_swapped", "scale, x along rows", mm.sectors(mm.block_warp((32, 8), m, swapped=True)), None)]
    code = _SECTORS_SNIPPET.format(n=n, m=m, strides=tuple(strides))
    try:
        got = profile.ncu(code, metrics=SECTOR_METRICS, kernel="copy_strided|transpose_|scale_2d", timeout=600)
    except profile.ProfilerUnavailable as exc:
        return {"available": False, "why": str(exc)}
    if len(got) != len(launches):
        return {"available": False, "why": f"ncu profiled {len(got)} launches, {len(launches)} were expected"}
    rows = []
    for (kernel, name, model_sectors, costs), r in zip(launches, got):
        if kernel not in r["kernel"]:
            return {"available": False, "why": f"ncu's launch {r['id']} is {r['kernel']!r}, not {kernel}"}
        metrics = {k: r.get(k) for k in SECTOR_METRICS}

        def per(num, den):
            return metrics[num] / metrics[den] if metrics.get(den) else None

        row = {"name": name, "kernel": kernel, "metrics": metrics,
               "load_sectors_per_request": per("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
                                               "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"),
               "store_sectors_per_request": per("l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
                                                "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"),
               "shared_wavefronts_per_load": per("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
                                                 "smsp__sass_inst_executed_op_shared_ld.sum")}
        if model_sectors is not None:
            row["model_load_sectors"] = model_sectors
        if costs is not None:
            row["model"] = costs
        rows.append(row)
    return {"available": True, "n": n, "m": m, "rows": rows}


_RACE_SNIPPET = r"""
import numpy as np
import gpucourse
gpucourse.setup("gpu", quiet=True)
from kernels import memory as mem
a = np.random.default_rng(0).random(({m}, {m}), dtype=np.float32)
got = mem.transpose(a, variant="{variant}")
print("transpose_{variant}: result", "equals a.T" if np.array_equal(got, a.T) else "DIFFERS from a.T")
"""


def find_sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.access(p, os.X_OK)), None)


def racecheck(m: int = 64) -> dict:
    """compute-sanitizer --tool racecheck on transpose_unsynced (the tile without cuda.syncthreads()) and on
    transpose_padded (with it), one m x m launch each: the hazards it reports and the last lines it printed."""
    exe = find_sanitizer()
    if exe is None:
        return {"available": False, "why": "compute-sanitizer (CUDA toolkit) is not installed here"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    out = {"available": True, "m": m, "runs": {}}
    for variant in ("unsynced", "padded"):
        with tempfile.TemporaryDirectory(prefix="gpucourse-race-") as tmp:
            script = os.path.join(tmp, "race.py")
            with open(script, "w") as f:
                f.write(_RACE_SNIPPET.format(m=m, variant=variant))
            try:
                r = subprocess.run([exe, "--tool", "racecheck", "--racecheck-report", "hazard", sys.executable,
                                    script], capture_output=True, text=True, timeout=300, env=env)
            except subprocess.TimeoutExpired:
                return {"available": False, "why": "compute-sanitizer did not finish within 300 s"}
        text = (r.stdout + r.stderr).strip()
        summary = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
        lines = [ln for ln in text.splitlines() if ln.startswith("=========") or "transpose_" in ln]
        out["runs"][variant] = {
            "returncode": r.returncode,
            "hazards": int(summary.group(1)) if summary else (0 if "ERROR SUMMARY: 0 errors" in text else None),
            "errors": int(summary.group(2)) if summary else None,
            "result_correct": "equals a.T" in text,
            "output": "\n".join(lines[:12] + (["..."] if len(lines) > 24 else []) + lines[-12:])
            if len(lines) > 24 else "\n".join(lines)}
    return out


# ------------------------------------------------------------------------------------------------------ run

def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    figures = {}
    for key, fig in FIGURES.items():
        figures[key] = fig.measure()
        runtime.cupy().get_default_memory_pool().free_all_blocks()
    return figures, ceilings


# ------------------------------------------------------------------------------------------- text and checks

def hierarchy_text(h: dict) -> str:
    lines = [f"SM clock {h['clock_ghz']:.2f} GHz while the chase ran",
             f"{'level':15} {'latency':>23} {'bandwidth':>14}"]
    for level in h["levels"]:
        lat = h["latency"][level]
        bw = h["bandwidth"].get(level)
        bw_text = f"{bw['gbps']:9,.0f} GB/s" if bw else ""
        lines.append(f"{level:15} {lat['cycles']:6.0f} cycles {lat['ns']:6.1f} ns {bw_text:>14}".rstrip())
    lines.append(f"{'copy (HBM)':15} {'':>23} {h['copy_gbps']:9,.0f} GB/s  read + written: the copy ceiling")
    return "\n".join(lines)


def stride_text(s: dict) -> str:
    lines = [f"{'stride':>6} {'sectors/warp':>13} {'GB/s useful':>12} {'model GB/s':>11} {'measured/model':>15}"]
    for r in s["rows"]:
        lines.append(f"{r['stride']:6} {r['sectors']:13} {r['gbps']:12,.0f} {r['model_gbps']:11,.0f} "
                     f"{r['gbps'] / r['model_gbps']:15.2f}")
    return "\n".join(lines)


def block_text(b: dict) -> str:
    lines = [f"{'block (x along columns unless said)':38} {'sectors/warp':>13} {'GB/s':>8} {'of copy':>8}"]
    for r in b["rows"]:
        lines.append(f"{r['name']:38} {r['sectors_per_warp']:13} {r['gbps']:8,.0f} {r['gbps'] / b['copy_gbps']:8.2f}")
    return "\n".join(lines)


def transpose_text(t: dict) -> str:
    lines = [f"{'transpose':10} {'median':>10} {'GB/s':>8} {'of copy':>8} {'model MB moved':>15} {'model time':>11} "
             f"{'bank ways':>10}"]
    for r in t["rows"]:
        lines.append(f"{r['variant']:10} {bench.format_ms(r['median_ms']):>10} {r['gbps']:8,.0f} {r['of_copy']:8.2f} "
                     f"{r['model_bytes'] / 1e6:15,.0f} {bench.format_ms(r['model_ms']):>11} "
                     f"{r['shared_ways'] or '-':>10}")
    return "\n".join(lines)


def matmul_text(m: dict) -> str:
    lines = [f"{'FP32 matmul':10} {'median':>10} {'TFLOP/s':>8} {'FLOP/byte asked':>16} {'FLOP/byte HBM':>14} "
             f"{'rel. error':>11}"]
    for r in m["rows"]:
        hbm = f"{r['dram_intensity']:14.1f}" if "dram_intensity" in r else f"{'-':>14}"
        lines.append(f"{r['name']:10} {bench.format_ms(r['median_ms']):>10} {r['tflops']:8.2f} {r['intensity']:16.2f} "
                     f"{hbm} {r['rel_error']:11.1e}")
    return "\n".join(lines)


def sectors_text(s: dict) -> str:
    if not s.get("available"):
        return f"no profiler counts: {s.get('why')}"
    lines = [f"{'launch':24} {'ld sectors/req':>15} {'model':>6} {'st sectors/req':>15} {'shared wavefronts/ld':>21} "
             f"{'model':>6}"]
    for r in s["rows"]:
        model = r.get("model", {})
        ld_model = r.get("model_load_sectors", model.get("global load sectors"))
        ways = model.get("shared load ways")

        def f(v):
            return f"{v:.2f}" if v is not None else "-"

        lines.append(f"{r['name']:24} {f(r['load_sectors_per_request']):>15} {ld_model or '-':>6} "
                     f"{f(r['store_sectors_per_request']):>15} {f(r['shared_wavefronts_per_load']):>21} "
                     f"{ways or '-':>6}")
    return "\n".join(lines)


_MANGLED = re.compile(r"kernels::memory::(\w+)\[abi:[^\]]*\]\(.*\)(\+0x[0-9a-f]+)")


def _racecheck_line(line: str, width: int = 100) -> str:
    """One line of racecheck's report as a notebook shows it: numba's mangled kernel name (module, ABI tag,
    argument types) cut to the kernel's own name, and what is still wider than ``width`` cut with an ellipsis."""
    line = _MANGLED.sub(r"\1\2", line)
    return line if len(line) <= width else line[: width - 3] + "..."


def racecheck_text(r: dict) -> str:
    if not r.get("available"):
        return f"no racecheck: {r.get('why')}"
    return "\n\n".join(f"$ compute-sanitizer --tool racecheck  (transpose_{v})\n"
                       + "\n".join(_racecheck_line(ln) for ln in run["output"].splitlines())
                       for v, run in r["runs"].items())


def _rows(fig: dict, key: str) -> dict:
    return {r[key]: r for r in fig["rows"]}


def _readings(figures: dict) -> dict:
    """{figure name: [(statement, holds)]}: what notebook 03 says about each figure (see ``reading``)."""
    h, s = figures.get("hierarchy", {}), figures.get("strides", {})
    t, m, b = figures.get("transposes", {}), figures.get("matmuls", {}), figures.get("blocks", {})
    sec, race = figures.get("sectors", {}), figures.get("racecheck", {})
    cmp = claims.compare

    def lat(level):
        return lambda: h["latency"][level]["ns"]

    def bw(level):
        return lambda: h["bandwidth"][level]["gbps"] if level != "copy" else h["copy_gbps"]

    def stride(k, key="gbps"):
        return lambda: _rows(s, "stride")[k][key]

    def block(blk, swapped):
        return lambda: next(r["gbps"] for r in b["rows"] if tuple(r["block"]) == blk and r["swapped"] == swapped)

    def tr(variant, key="gbps"):
        return lambda: _rows(t, "variant")[variant][key]

    def mmr(name, key="tflops"):
        return lambda: _rows(m, "name")[name][key]

    def roof(name):  # TFLOP/s the copy ceiling allows at the intensity the model counts (no cache)
        return lambda: mmr(name, "intensity")() * m["copy_gbps"] / 1e3

    def ridge():  # FLOP/byte where cuBLAS's FP32 rate meets the copy ceiling
        return m["fp32_tflops"] * 1e3 / m["copy_gbps"]

    def ncu(name, key):
        return lambda: _rows(sec, "name")[name][key] if sec.get("available") else None

    def ncu_equals_model():
        if not sec.get("available"):
            return None
        return all(abs(r["load_sectors_per_request"] - r.get("model_load_sectors", r.get("model", {}).get(
            "global load sectors"))) <= 0.02 * r["load_sectors_per_request"] for r in sec["rows"])

    def hazards(variant):
        return lambda: race["runs"][variant]["hazards"] if race.get("available") else None

    return {
        "hierarchy": [
            cmp("latency: registers", "below", "shared memory", lat("registers"), lat("shared memory"), 0.2),
            cmp("latency: shared memory", "below", "L2", lat("shared memory"), lat("L2"), 0.2),
            cmp("latency: L1", "below", "L2", lat("L1"), lat("L2"), 0.2),
            cmp("latency: L2", "below", "HBM", lat("L2"), lat("HBM"), 0.2),
            cmp("bandwidth: shared memory", "above", "L2", bw("shared memory"), bw("L2"), 0.2),
            cmp("bandwidth: L1", "above", "L2", bw("L1"), bw("L2"), 0.2),
            cmp("bandwidth: L2", "above", "HBM", bw("L2"), bw("HBM"), 0.2),
            cmp("bandwidth: HBM read probe", "level with", "the copy ceiling", bw("HBM"), bw("copy"), 0.1),
        ],
        "blocks": [
            *(cmp(f"{x} x {y}, x along the rows", "below", f"{x} x {y}, x along the columns", block((x, y), True),
                  block((x, y), False), 0.02) for x, y in BLOCKS),
            cmp("32 x 8, x along the rows (32 sectors a warp)", "below", "a third of 32 x 8 along the columns",
                block((32, 8), True), lambda: block((32, 8), False)() / 3),
            cmp("8 x 32, x along the rows (8 sectors a warp)", "level with", "8 x 32 along the columns",
                block((8, 32), True), block((8, 32), False), 0.1),
        ],
        "strides": [
            *(cmp(f"useful GB/s at stride {2 * k}", "below", f"stride {k}'s", stride(2 * k), stride(k), 0.05)
              for k in (1, 2, 4)),
            cmp("useful GB/s at stride 32", "below", "a quarter of stride 1's", stride(32),
                lambda: stride(1)() / 4),
            *(cmp(f"stride {k}, measured GB/s", "level with", "the model's", stride(k), stride(k, "model_gbps"),
                  0.2) for k in (4, 8)),
            *(cmp(f"stride {k}, measured GB/s", "below", "the model's", stride(k), stride(k, "model_gbps"), 0.2)
              for k in (1, 16, 32)),
        ],
        "sectors": [
            ("ncu's sectors per load request: equal to the model's, for every launch", holds(ncu_equals_model)),
            cmp("ncu's shared wavefronts per load, tiled transpose", "level with", "the model's 32 ways",
                ncu("tiled", "shared_wavefronts_per_load"), 32, 0.05),
            cmp("ncu's shared wavefronts per load, padded transpose", "level with", "the model's 1 way",
                ncu("padded", "shared_wavefronts_per_load"), 1, 0.05),
        ],
        "transposes": [
            cmp("tiled transpose", "above", "naive", tr("tiled"), tr("naive"), 0.2),
            cmp("padded transpose", "above", "tiled (no bank conflicts)", tr("padded"), tr("tiled"), 0.2),
            cmp("padded transpose", "above", "half the copy's GB/s", tr("padded"), lambda: t["copy_gbps"] / 2),
            cmp("padded transpose", "below", "the copy's GB/s", tr("padded"), lambda: t["copy_gbps"], 0.2),
            cmp("padded transpose, the bytes the model moves", "level with", "the bytes a copy moves",
                tr("padded", "model_bytes"), lambda: t["bytes"], 0.01),
            cmp("naive transpose", "below", "a quarter of the copy's GB/s", tr("naive"),
                lambda: t["copy_gbps"] / 4),
            cmp("naive transpose's time", "above", "the model's time at the copy ceiling", tr("naive", "median_ms"),
                tr("naive", "model_ms"), 0.2),
        ],
        "matmuls": [
            cmp("tiled matmul's TFLOP/s", "above", "3x the naive one's", mmr("tiled"), lambda: 3 * mmr("naive")()),
            cmp("cuBLAS's TFLOP/s", "above", "2x the tiled one's", mmr("cuBLAS"), lambda: 2 * mmr("tiled")()),
            cmp("naive matmul", "above", "its roof at the intensity asked for (the caches help)", mmr("naive"),
                roof("naive"), 0.1),
            cmp("tiled matmul", "below", "its roof at the intensity asked for", mmr("tiled"), roof("tiled"), 0.1),
            cmp("naive and tiled matmul, intensity asked for", "below", "the ridge (cuBLAS TFLOP/s / copy GB/s)",
                lambda: max(mmr("naive", "intensity")(), mmr("tiled", "intensity")()), ridge, 0.1),
        ],
        "racecheck": [
            cmp("racecheck's hazards, transpose without syncthreads", "above", "zero", hazards("unsynced"), 0),
            cmp("racecheck's hazards, padded transpose", "level with", "zero", hazards("padded"), 0),
        ],
    }


def reading(figures: dict, figure: str | None = None) -> list:
    """What notebook 03 says in words about its figures, each statement with whether it holds in ``figures`` (a
    run's or a record's): [(statement, True, False or None)], None where the figures lack what it needs. The words
    come from the relation each tests (gpucourse.claims.compare). ``figure``: only the statements about that one
    (the notebook prints them under it). A records test asserts every statement of every figure a record holds."""
    read = _readings(figures)
    if figure is not None:
        return read[figure]
    return [statement for name in read for statement in read[name]]


def reading_view(figure: str, shown) -> plots.Table:
    """The statements of ``reading`` about one figure, checked on the figure a notebook cell just showed
    (``shown``: benchmarks.show's (data, source)), labelled with its source."""
    data, source = shown
    return claims.view({"holds": reading({figure: data or {}}, figure)}, title="What the figure says, checked",
                       source=source)


# ------------------------------------------------------------------------------------------------- figures

def plot_hierarchy(h: dict, source: str):
    """One picture of the hierarchy: latency (ns) and bandwidth (GB/s) of each level, side by side, log scales."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = h["levels"]
    lat = [h["latency"][lv]["ns"] for lv in levels]
    colours = plt.get_cmap("viridis")(np.linspace(0.1, 0.85, len(levels)))
    left.barh(levels, lat, color=colours)
    for i, (v, lv) in enumerate(zip(lat, levels)):
        left.text(v, i, f" {plots.number(v)} ns ({h['latency'][lv]['cycles']:.0f} cycles)", va="center", fontsize=8)
    left.set_xscale("log")
    left.set_xlim(min(lat) / 2, max(lat) * 20)
    left.invert_yaxis()
    left.set_xlabel("latency of one dependent access (ns, log scale)")
    left.set_title("latency: a pointer chase (registers: a chain of FMAs)", fontsize=9)
    bw_levels = [lv for lv in levels if lv in h["bandwidth"]] + ["copy (HBM)"]
    bw = [h["bandwidth"][lv]["gbps"] for lv in bw_levels[:-1]] + [h["copy_gbps"]]
    right.barh(bw_levels, bw, color=[colours[levels.index(lv)] if lv in levels else "tab:red" for lv in bw_levels])
    for i, v in enumerate(bw):
        right.text(v, i, f" {plots.number(v)} GB/s", va="center", fontsize=8)
    right.set_xscale("log")
    right.set_xlim(min(bw) / 2, max(bw) * 10)
    right.invert_yaxis()
    right.set_xlabel("bandwidth, all SMs together (GB/s, log scale)")
    right.set_title("bandwidth: read probes (copy: read + written)", fontsize=9)
    for ax in (left, right):
        ax.grid(True, which="both", axis="x", alpha=0.3)
    fig.suptitle(f"The memory hierarchy, SM clock {h['clock_ghz']:.2f} GHz\n{source}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_strides(s: dict, source: str):
    xs = [r["stride"] for r in s["rows"]]
    fig = plots.lines({"copy_strided, measured": (xs, [r["gbps"] for r in s["rows"]])},
                      models={"model: sectors per warp at the copy ceiling": (xs, [r["model_gbps"] for r in s["rows"]])},
                      levels={"copy ceiling, GB/s": s["copy_gbps"]},
                      xlabel="stride (elements between neighbouring threads' reads)",
                      ylabel="useful GB/s (n read + n written)", source=source,
                      title=f"Coalescing: dst[i] = src[i * stride], {s['n']:,} float32")
    ax = fig.axes[0]
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['stride']}\n{r['sectors']} sect." for r in s["rows"]], fontsize=8)
    fig.tight_layout()
    return fig


def plot_blocks(b: dict, source: str):
    return plots.bars({r["name"]: r["gbps"] for r in b["rows"]}, unit="GB/s", source=source,
                      ceiling=("copy ceiling", b["copy_gbps"]),
                      title=f"2-D scale of a {b['n']:,} x {b['n']:,} float32 matrix, by block shape")


def plot_transposes(t: dict, source: str):
    return plots.bars({f"{r['variant']} ({r['shared_ways'] or 'no'} shared ways)" if r["variant"] != "naive"
                       else "naive": r["gbps"] for r in t["rows"]}, unit="GB/s", source=source,
                      ceiling=("copy ceiling (read + written)", t["copy_gbps"]),
                      title=f"Transposing a {t['n']:,} x {t['n']:,} float32 matrix")


def plot_matmuls(m: dict, source: str):
    points = {}
    for r in m["rows"]:
        if "dram_intensity" in r:
            points[f"{r['name']} (bytes asked for)"] = (r["intensity"], r["tflops"])
            points[f"{r['name']} (bytes from HBM, ncu)"] = (r["dram_intensity"], r["tflops"])
        else:
            points[r["name"]] = (r["intensity"], r["tflops"])
    return plots.roofline(bandwidth_gbps=m["copy_gbps"], peaks_tflops={"FP32 (cuBLAS)": m["fp32_tflops"]},
                          points=points, source=source,
                          title=f"FP32 matrix multiply, {m['n']:,}^3: naive, tiled ({m['tile']} x {m['tile']}), cuBLAS")


# ---------------------------------------------------------------------------------------------- the registry

FIGURES = {  # what run() records, in this order
    "hierarchy": Figure(hierarchy, plot_hierarchy, hierarchy_text),
    "strides": Figure(stride_sweep, plot_strides, stride_text),
    "blocks": Figure(block_shapes, plot_blocks, block_text),
    "transposes": Figure(transposes, plot_transposes, transpose_text),
    "matmuls": Figure(matmuls, plot_matmuls, matmul_text),
    "sectors": Figure(sectors, text=sectors_text, optional=True),
    "racecheck": Figure(racecheck, text=racecheck_text, optional=True),
}


# ------------------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline."""
    from gpucourse import results as R

    f = record["figures"]
    t = {r["variant"]: r for r in f.get("transposes", {}).get("rows", [])}
    m = {r["name"]: r for r in f.get("matmuls", {}).get("rows", [])}
    h = f.get("hierarchy", {})
    lat = h.get("latency", {})

    def ns(levels):
        if not all(lv in lat for lv in levels):
            return None
        return " / ".join(f"{lat[lv]['ns']:.0f}" for lv in levels) + " ns"

    return [
        ("padded-tile transpose, share of the copy ceiling", R.share(t.get("padded", {}).get("of_copy")),
         "transposes"),
        ("naive / tiled / padded transpose, share of the copy ceiling",
         R.joined([t.get(v, {}).get("of_copy") for v in mem.VARIANTS], R.share) if t else None, "transposes"),
        ("tiled over naive FP32 matmul (numba)",
         R.ratio(m["tiled"]["tflops"] / m["naive"]["tflops"]) if "tiled" in m and "naive" in m else None, "matmuls"),
        ("latency of L1 / L2 / HBM (pointer chase)", ns(("L1", "L2", "HBM")), "hierarchy"),
    ]
