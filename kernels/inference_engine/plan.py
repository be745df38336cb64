"""The plan file: what a built engine is (``Plan``: header, steps, arrays), its format with a checksum, and
the check that it runs on this machine (``check_target``).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpucourse import runtime

from .graph import _json_bytes


PLAN_MAGIC = "GPUCOURSE-ENGINE-PLAN"
PLAN_FORMAT = 1


@dataclass
class Plan:
    """What the builder decided: buffers, one step per kernel launch, weights in the arena's precision,
    kernel choices with their timings. ``header`` is JSON; ``arrays`` hold the weights."""

    header: dict
    arrays: dict

    @property
    def steps(self) -> list:
        return self.header["steps"]

    @property
    def launches(self) -> int:
        """Kernels per inference: one per step."""
        return len(self.steps)

    @property
    def host_launches(self) -> int:
        """Launches the host makes per inference: one graph launch with CUDA graphs, one per kernel without."""
        return 1 if self.header.get("graphs") else len(self.steps)

    def save(self, path) -> Path:
        """Write the plan: an .npz (no pickle) of the weights and the JSON header with its checksum."""
        header = dict(self.header, checksum=_checksum(self.header, self.arrays))
        path = Path(path)
        with open(path, "wb") as f:
            np.savez(f, header=_json_bytes(header), **{f"a/{k}": v for k, v in self.arrays.items()})
        return path


def _checksum(header: dict, arrays: dict) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def this_target() -> dict:
    """What a plan is built for: this GPU (name, compute capability) in GPU mode, NumPy in CPU mode. The compute
    capability is the one the course builds for (``runtime.compute_capability``, as gpucourse/gpus.py answers): the
    GPU's own, or GPUCOURSE_FAKE_CC where that is set. The builder chooses kernels for that capability (the auto-tuner's
    candidates, FP8, the fallbacks), so a plan built under one faked capability must not run under another, nor
    under the GPU's own."""
    rt = runtime.get()
    if rt.gpu:
        cc = runtime.compute_capability()
        return {"kind": "gpu", "name": rt.device["name"],
                "compute_capability": f"{cc[0]}.{cc[1]}" if cc else rt.device["compute_capability"]}
    return {"kind": "numpy", "name": "NumPy (CPU mode)", "compute_capability": None}


def load_plan(path) -> Plan:
    """Read a plan file, refusing (CourseError, saying what differs) a file that is not a plan, is damaged,
    has another format version, or was built for another GPU or runtime. Nothing is re-optimised."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # every .npz is a zip archive
                raise runtime.CourseError(f"{path} is not a plan file (not an .npz archive)")
        with np.load(path, allow_pickle=False) as f:
            header = json.loads(bytes(f["header"]).decode())
            arrays = {k[2:]: f[k] for k in f.files if k.startswith("a/")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise runtime.CourseError(f"{path} is not a readable plan file (damaged, or not a plan): "
                                  f"{type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("magic") != PLAN_MAGIC:
        raise runtime.CourseError(f"{path} is not a plan of this engine (no {PLAN_MAGIC} header)")
    if header.get("format") != PLAN_FORMAT:
        raise runtime.CourseError(f"{path} has plan format version {header.get('format')}; this runtime reads "
                                  f"version {PLAN_FORMAT}: rebuild the plan with build_plan")
    if header.get("checksum") != _checksum(header, arrays):
        raise runtime.CourseError(f"{path}: checksum mismatch, the file was changed or damaged after it was "
                                  "written; refusing to run it")
    plan = Plan(header, arrays)
    check_target(plan)
    return plan


def check_target(plan: Plan) -> None:
    built, here = plan.header["target"], this_target()
    for key in ("kind", "name", "compute_capability"):
        if built.get(key) != here.get(key):
            fake = os.environ.get(runtime.FAKE_CC_VARIABLE) if here["kind"] == "gpu" else None
            why = (f" ({runtime.FAKE_CC_VARIABLE}={fake} is set: the course builds for a GPU of compute capability "
                   f"{here['compute_capability']})" if fake else "")
            raise runtime.CourseError(
                f"this plan was built for {built['name']} (compute capability {built['compute_capability']}), "
                f"and this machine runs {here['name']} (compute capability {here['compute_capability']}){why}: its "
                f"{key.replace('_', ' ')} differs. A plan's kernels are chosen and timed for one GPU; rebuild "
                "the plan here" + (f", or run with the {runtime.FAKE_CC_VARIABLE} it was built with" if fake
                                   or (built.get("kind") == "gpu" and key == "compute_capability") else ""))
