"""Lesson 8 — sharing one GPU between processes: the MPS control daemon, started and always stopped.

Without MPS, kernels of different processes never run at the same time: the GPU time-slices between their
contexts. The Multi-Process Service funnels every client's work through one server context, so small
kernels of many processes share the SMs at once. ``Daemon`` starts ``nvidia-cuda-mps-control -d`` with
private pipe and log folders (so it can never meet another user's daemon), waits for it with time-outs,
and stops it with ``quit`` in a ``finally``, checking that no process of it remains::

    with mps.Daemon() as d:
        subprocess.run([...], env=d.client_env())   # clients must see the same two folders

If the daemon cannot start, ``MPSUnavailable`` says why (the daemon's own log line when it wrote one) and
nothing is left running. While a daemon runs (started in the main thread), SIGTERM and SIGHUP raise
``SystemExit`` instead of ending the process on the spot, so the ``with`` block (or a ``finally``) still stops
the daemon when the benchmark is killed that way; ``stop()`` puts the previous handlers back.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpucourse import runtime

BINARY = "nvidia-cuda-mps-control"
PIPE, LOG = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
LOGS = ("control.log", "server.log")  # the control daemon's log, and the MPS server's (where it says why it failed)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


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
        self.last_log = ""  # the log's last lines, kept by stop() after the folders are removed
        self._previous_handlers: dict = {}
        self._stopping = False
        self._pending_signal = None

    def client_env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env[PIPE], env[LOG] = self.pipe_dir, self.log_dir
        return env

    def _control(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary], input=command + "\n", capture_output=True, text=True,
                              env=self.client_env(), timeout=timeout)

    def log_tail(self, lines: int = 3) -> str:
        """The last ``lines`` lines of the control daemon's control.log and of the MPS server's server.log (where
        each says why it failed), labelled: "control.log: ... | ...; server.log: ...". "" while neither has a line."""
        if self.log_dir is None:
            return ""
        parts = []
        for name in LOGS:
            try:
                text = [ln.strip() for ln in (Path(self.log_dir) / name).read_text(errors="replace").splitlines()
                        if ln.strip()]
            except OSError:
                continue
            if text:
                parts.append(f"{name}: " + " | ".join(text[-lines:]))
        return "; ".join(parts)

    # A SIGTERM or SIGHUP would end the process at once and leave the daemonised control process running. While
    # the daemon runs, they raise SystemExit instead, so ``finally`` / ``__exit__`` stop it; one that arrives
    # while stop() cleans up waits until the clean-up is done. Python can set handlers in the main thread only.
    def _on_signal(self, signum, frame) -> None:
        if self._stopping:
            self._pending_signal = signum
            return
        print(f"{signal.Signals(signum).name} received: stopping the MPS daemon, then exiting", file=sys.stderr,
              flush=True)
        raise SystemExit(128 + signum)

    def _catch_signals(self) -> None:
        if self._previous_handlers or threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # ignored on purpose (nohup): leave it so
                continue
            self._previous_handlers[sig] = previous
            signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous_handlers = {}
        pending, self._pending_signal = self._pending_signal, None
        if pending is not None:
            raise SystemExit(128 + pending)

    def start(self) -> "Daemon":
        if self.binary is None:
            raise MPSUnavailable(f"MPS is unavailable: {self.asked} was not found (it comes with the NVIDIA "
                                 "driver on Linux; it is absent on Windows, WSL and most containers)")
        self._catch_signals()  # before anything is started: a SIGTERM from here on stops what was started
        try:
            self.pipe_dir = tempfile.mkdtemp(prefix="gpucourse-mps-pipe-")
            self.log_dir = tempfile.mkdtemp(prefix="gpucourse-mps-log-")
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
        remove the folders, keeping the log's last lines in ``last_log``; then put back the signal handlers that
        start() replaced. Safe to call more than once, and after a failed start."""
        if self.pipe_dir is None:
            self._restore_signals()
            return
        self._stopping = True
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
            if self.log_dir is not None:
                shutil.rmtree(self.log_dir, ignore_errors=True)
            self.pipe_dir = self.log_dir = None
            self.started = False
            self._stopping = False
            self._restore_signals()  # raises SystemExit if a SIGTERM / SIGHUP came during the clean-up

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
