"""Lesson 7 — sharing one GPU between processes: the MPS control daemon, started and always stopped.

Without MPS, kernels of different processes never run at the same time: the GPU time-slices between their
contexts. The Multi-Process Service funnels every client's work through one server context, so small
kernels of many processes share the SMs at once. ``Daemon`` starts ``nvidia-cuda-mps-control -d`` with
private pipe and log folders (so it can never meet another user's daemon), waits for it with time-outs,
and stops it with ``quit`` in a ``finally``, checking that no process of it remains::

    with mps.Daemon() as d:
        subprocess.run([...], env=d.client_env())   # clients must see the same two folders

If the daemon cannot start, ``MPSUnavailable`` says why (the daemon's own log line when it wrote one) and
nothing is left running.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from gpucourse import runtime

BINARY = "nvidia-cuda-mps-control"
PIPE, LOG = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"


class MPSUnavailable(runtime.CourseError, RuntimeError):
    """MPS was asked for but its daemon cannot run here; the message says why."""


def find_binary(path: str | None = None) -> str | None:
    if path is not None:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(BINARY) or next((p for p in ("/usr/bin/" + BINARY, "/usr/local/cuda/bin/" + BINARY)
                                         if os.access(p, os.X_OK)), None)


def processes_with(variable: str, value: str) -> list[int]:
    """Ids of the processes (readable by this user) whose environment has variable=value: the daemon and its
    server, found by their private pipe folder and nothing else."""
    want = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            found.append(int(entry.name))
    return found


class Daemon:
    """The MPS control daemon with private folders: ``start()``, ``stop()`` (or a ``with`` block)."""

    def __init__(self, binary: str | None = None, *, timeout: float = 15.0):
        self.binary = find_binary(binary)
        self.asked = binary or BINARY
        self.timeout = timeout
        self.pipe_dir = self.log_dir = None
        self.started = False

    def client_env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env[PIPE], env[LOG] = self.pipe_dir, self.log_dir
        return env

    def _control(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary], input=command + "\n", capture_output=True, text=True,
                              env=self.client_env(), timeout=timeout)

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of the daemon's control.log (where it says why it failed)."""
        if self.log_dir is None:
            return ""
        path = Path(self.log_dir) / "control.log"
        try:
            text = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def start(self) -> "Daemon":
        if self.binary is None:
            raise MPSUnavailable(f"MPS is unavailable: {self.asked} was not found (it comes with the NVIDIA "
                                 "driver on Linux; it is absent on Windows, WSL and most containers)")
        self.pipe_dir = tempfile.mkdtemp(prefix="gpucourse-mps-pipe-")
        self.log_dir = tempfile.mkdtemp(prefix="gpucourse-mps-log-")
        try:
            try:
                r = subprocess.run([self.binary, "-d"], env=self.client_env(), capture_output=True, text=True,
                                   timeout=self.timeout)
            except subprocess.TimeoutExpired:
                raise MPSUnavailable(f"MPS is unavailable: `{self.binary} -d` did not return within "
                                     f"{self.timeout:.0f} s") from None
            self.started = True
            if r.returncode != 0:
                why = self.log_tail() or (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
                raise MPSUnavailable(f"MPS is unavailable: the control daemon did not start: {why}")
            deadline = time.monotonic() + self.timeout
            while True:  # ready when it answers a query on its pipe
                try:
                    if self._control("get_server_list", timeout=max(0.5, deadline - time.monotonic())).returncode == 0:
                        break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() > deadline:
                    raise MPSUnavailable("MPS is unavailable: the control daemon did not answer within "
                                         f"{self.timeout:.0f} s" + (f": {self.log_tail()}" if self.log_tail() else ""))
                time.sleep(0.1)
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """``quit``, wait for every process of the daemon to end (killing any that outlive the time-out), and
        remove the folders. Safe to call more than once, and after a failed start."""
        if self.pipe_dir is None:
            return
        try:
            if self.started:
                try:
                    self._control("quit", timeout=self.timeout)
                except (subprocess.TimeoutExpired, OSError):
                    pass
            deadline = time.monotonic() + self.timeout
            while processes_with(PIPE, self.pipe_dir) and time.monotonic() < deadline:
                time.sleep(0.1)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                left = processes_with(PIPE, self.pipe_dir)
                for pid in left:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                end = time.monotonic() + 5
                while processes_with(PIPE, self.pipe_dir) and time.monotonic() < end:
                    time.sleep(0.1)
            left = processes_with(PIPE, self.pipe_dir)
            if left:
                raise runtime.CourseError(f"MPS daemon processes {left} did not end; stop them by hand")
        finally:
            self.last_log = self.log_tail(20)
            shutil.rmtree(self.pipe_dir, ignore_errors=True)
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.pipe_dir = self.log_dir = None
            self.started = False

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def running(binary: str | None = None) -> tuple[bool, str]:
    """(True, "") if a daemon starts and stops here, else (False, why): what a benchmark records."""
    try:
        with Daemon(binary):
            return True, ""
    except MPSUnavailable as exc:
        return False, str(exc)
