"""Nsight Compute from Python, for any lesson: profile a snippet's kernels and read their metrics.

    rows = profile.ncu(code, metrics=profile.DEFAULT_METRICS, kernel="multiply")

runs ``ncu --clock-control none --csv --metrics ... python snippet.py`` in a subprocess (the GPU's clocks
are left as they are: ncu would otherwise lock them to base clock), and parses its CSV into one dict per
kernel launch: {"kernel", "id", metric name: value}. When ncu is missing, or cannot read the performance
counters (ERR_NVGPUCTRPERM: counters are restricted to administrators by default), ``ProfilerUnavailable``
says so plainly.
"""
from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

from .runtime import CourseError

DEFAULT_METRICS = {
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput (% of peak)",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy (%)",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "FMA pipe utilisation (%)",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe utilisation (%)",
    "gpu__time_duration.sum": "duration",
}


class ProfilerUnavailable(CourseError, RuntimeError):
    """ncu cannot profile here; the message says why."""


def find_ncu() -> str | None:
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.access(p, os.X_OK)), None)


def _number(text: str):
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return text.strip()


def parse_csv(output: str) -> list[dict]:
    """ncu's --csv output (with the program's own output and ==PROF== lines around it) -> one dict per
    profiled kernel launch, in launch order: {"id", "kernel", "units": {metric: unit}, metric: value}."""
    lines = output.splitlines()
    errors = [ln for ln in lines if ln.startswith("==ERROR==")]
    if any("ERR_NVGPUCTRPERM" in ln for ln in errors):
        raise ProfilerUnavailable("ncu cannot read the GPU's performance counters here (ERR_NVGPUCTRPERM): "
                                  "they are restricted to administrators on this machine")
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        why = "; ".join(e.removeprefix("==ERROR==").strip() for e in errors) or "no kernel was profiled"
        raise ProfilerUnavailable(f"ncu gave no metrics: {why}")
    body = [ln for ln in lines[start:] if ln.startswith('"')]
    rows: dict = {}
    for rec in csv.DictReader(io.StringIO("\n".join(body))):
        key = rec["ID"]
        row = rows.setdefault(key, {"id": int(key), "kernel": rec.get("Kernel Name", ""), "units": {}})
        name = rec["Metric Name"]
        row[name] = _number(rec["Metric Value"])
        row["units"][name] = rec.get("Metric Unit", "")
    return sorted(rows.values(), key=lambda r: r["id"])


def ncu(code: str, *, metrics=DEFAULT_METRICS, kernel: str | None = None, launch_count: int | None = None,
        timeout: float = 300, env: dict | None = None) -> list[dict]:
    """Profile the kernels a Python snippet launches (``kernel``: a regular expression their names must
    match; ``launch_count``: stop after that many), with the course's root on its PYTHONPATH (the snippet imports
    kernels/ and benchmarks/). Returns ``parse_csv``'s rows."""
    exe = find_ncu()
    if exe is None:
        raise ProfilerUnavailable("Nsight Compute (ncu) is not installed here: it comes with the CUDA toolkit "
                                  "(or `pip install nvidia-nsight-compute`), and profiling needs a GPU")
    with tempfile.TemporaryDirectory(prefix="gpucourse-ncu-") as tmp:
        script = os.path.join(tmp, "snippet.py")
        with open(script, "w") as f:
            f.write(code)
        cmd = [exe, "--clock-control", "none", "--csv", "--metrics", ",".join(metrics)]
        if kernel:
            cmd += ["--kernel-name", f"regex:{kernel}"]
        if launch_count:
            cmd += ["--launch-count", str(launch_count)]
        cmd += [sys.executable, script]
        env = dict(os.environ if env is None else env)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                               cwd=os.getcwd())
        except subprocess.TimeoutExpired:
            raise ProfilerUnavailable(f"ncu did not finish within {timeout:.0f} s") from None
    out = r.stdout + "\n" + r.stderr
    try:
        return parse_csv(out)
    except ProfilerUnavailable as exc:
        tail = "\n".join(out.strip().splitlines()[-5:])
        raise ProfilerUnavailable(f"{exc} (exit status {r.returncode}; last lines: {tail})") from None


def short_name(kernel: str, width: int = 40) -> str:
    name = re.sub(r"\(.*", "", kernel)
    return name if len(name) <= width else name[: width - 1] + "…"
