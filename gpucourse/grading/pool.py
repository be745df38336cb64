"""The grader's side of the workers: a throwaway course (its source, guarded kernelspec and environment)
and a pool of worker processes that grade submissions in parallel, with time-outs on every wait.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .. import runtime
from .course import ENV_NAMES, ENV_PREFIXES, IGNORED, assignment_files, course_config, prepend_paths, tail
from .reports import GradeReport, TestResult
from .settings import GradingError, KERNEL_CODE, KERNEL_NAME, Limits, REPO, SOLUTIONS, STARTUP_SLACK, is_within
from .worker import guarded_config


def require_nbgrader() -> None:
    """A clear GradingError where nbgrader is not installed, before any worker starts (a worker without it would
    only stop answering)."""
    import importlib.util

    if importlib.util.find_spec("nbgrader") is None:
        raise GradingError(f"nbgrader is not installed in this Python ({sys.executable}): the grader runs nbgrader's "
                           "autograder. Install the course's environment (environment.yml, or pip install -e .)")


class Course:
    """One grading run's directories and workers.

        <root>/                 nbgrader's course directory: gradebook.db, source/, release/, submitted/,
                                autograded/, feedback/, grades.csv
        <root>/.grader/code/    the copy of the course's code that workers and kernels import
        <root>/.grader/jupyter/ the guarded kernel's kernelspec; empty Jupyter config and runtime folders
        <root>/.grader/kernels/ each kernel's pid file and private folder (home, temporary files, log)
        <root>/.grader/logs/    the workers' logs
    """

    def __init__(self, root: Path, source: Path, mode: str, limits: Limits, deny: Sequence[Path] = ()):
        require_nbgrader()
        self.root, self.source, self.mode, self.limits = root, source, mode, limits
        self.assignment, self.notebook = source.parent.name, source.stem
        aux = self.aux = root / ".grader"
        for sub in ("code", "jupyter/data/kernels", "jupyter/config", "jupyter/runtime", "kernels", "logs",
                    "home"):
            (aux / sub).mkdir(parents=True, exist_ok=True)
        src_dir = root / "source" / self.assignment
        src_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, src_dir / source.name)
        for extra in assignment_files(source.parent):
            dest = src_dir / extra.relative_to(source.parent)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(extra, dest)
        for name in KERNEL_CODE:
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, aux / "code" / name, ignore=shutil.ignore_patterns(*IGNORED, "*.pyc"))
        spec = aux / "jupyter/data/kernels" / KERNEL_NAME
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-c", "from gpucourse.grading.kernel import kernel_main; kernel_main()", "-f",
                     "{connection_file}"],
            "display_name": "Python 3 (graded)", "language": "python"}))
        home = Path.home()
        denied = self.denied = [REPO, SOLUTIONS, source.parent, root, home, *deny]
        self.policy = aux / "policy.json"
        self.policy.write_text(json.dumps({
            "deny": sorted({os.path.realpath(p) for p in denied} | {str(Path(p).absolute()) for p in denied}),
            "allow": [os.path.realpath(aux / "code"), str(aux / "code")],
            "kernels": str(aux / "kernels"), "mode": mode, "limits": asdict(limits)}))
        self.env = self._env()
        self.spec = aux / "worker.json"
        self.spec.write_text(json.dumps({
            "root": str(root), "assignment": self.assignment, "notebook": self.notebook, "mode": mode,
            "limits": asdict(limits), "config": {**course_config(root), **guarded_config(limits)}}))
        self.started: list[_Worker] = []

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
        env = {k: v for k, v in env.items() if k not in ("NUMBA_CACHE_DIR", "CUPY_CACHE_DIR")}
        # nbgrader runs the `alembic` script when it creates a gradebook: find this Python's scripts even
        # when its environment is not activated.
        env["PATH"] = prepend_paths([sysconfig.get_path("scripts"), os.path.dirname(sys.executable)], env.get("PATH", ""))
        # The course's code comes from the copy; anything else on the grader's PYTHONPATH stays reachable,
        # except what lies in the repository or the folders the kernel may not read.
        hidden = [os.path.realpath(p) for p in (REPO, self.root, *self.denied)]
        kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and not any(is_within(os.path.realpath(p), h) for h in hidden)]
        env.update({
            "PYTHONPATH": os.pathsep.join([str(self.aux / "code"), *kept]), "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "HOME": str(self.aux / "home"), "JUPYTER_PATH": str(self.aux / "jupyter/data"),
            "JUPYTER_DATA_DIR": str(self.aux / "jupyter/data"), "JUPYTER_CONFIG_DIR": str(self.aux / "jupyter/config"),
            "JUPYTER_RUNTIME_DIR": str(self.aux / "jupyter/runtime"), "JUPYTER_PLATFORM_DIRS": "1",
            "IPYTHONDIR": str(self.aux / "home/.ipython"), "GPUCOURSE_GRADER_POLICY": str(self.policy),
            runtime.MODE_VARIABLE: self.mode, "NUMBA_ENABLE_CUDASIM": "1" if self.mode == "cpu" else "0",
            "SQLALCHEMY_WARN_20": "0", "PYTHONWARNINGS": "ignore",
        })
        return env

    @contextlib.contextmanager
    def workers(self, count: int):
        pool = [_Worker(self, i) for i in range(count)]
        try:
            yield pool
        finally:
            for w in [*pool, *self.started]:
                w.stop()
            self._kill_kernels()

    def restart(self, worker: _Worker) -> _Worker:
        worker.stop(kill=True)
        self._kill_kernels(parent=worker.proc.pid)
        fresh = _Worker(self, worker.index)
        self.started.append(fresh)
        fresh.ask({"op": "ready"}, STARTUP_SLACK)
        return fresh

    def _kill_kernels(self, parent: int | None = None) -> None:
        """End the guarded kernels a worker left behind (only ours: found by their pid files)."""
        for pid_file in (self.aux / "kernels").glob("*.pid"):
            try:
                pid, ppid = int(pid_file.stem), int(pid_file.read_text().split()[0])
            except (ValueError, IndexError, OSError):
                continue
            if parent is not None and ppid != parent:
                continue
            try:
                ours = b"kernel_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                    str(self.aux).encode() in Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if ours:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def generate(self, worker: _Worker) -> None:
        answer = worker.ask({"op": "generate"}, 180 + STARTUP_SLACK)
        if not answer or not answer.get("ok"):
            why = (answer or {}).get("error") or "the worker stopped answering"
            raise GradingError(f"nbgrader generate_assignment failed for {self.assignment}: {why}",
                               (answer or {}).get("log", "") + worker.log_tail())

    def grade_one(self, worker: _Worker, student: str, submission: Path) -> dict:
        """Grade one submission on ``worker``; {"ok": False, "error": ..., "restart": True} when the worker had
        to be stopped."""
        inbox = self.aux / "inbox" / student
        inbox.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(submission, inbox / self.source.name)
        except OSError as exc:
            return {"ok": False, "error": f"cannot read {submission}: {exc.strerror}"}
        limit = self.limits.notebook_timeout + STARTUP_SLACK
        answer = worker.ask({"op": "grade", "student": student, "path": str(inbox / self.source.name)}, limit)
        if answer is None:
            code = worker.proc.poll()
            why = (f"the grading process ended (exit status {code}) while it graded this notebook" if code is not None
                   else f"grading went on past {limit} s, the notebook's {self.limits.notebook_timeout} s limit and "
                        f"{STARTUP_SLACK} s to start and stop, so the grader stopped it")
            return {"ok": False, "restart": True, "error": f"{why}; it gets no points", "log": worker.log_tail()}
        return answer

    def finish(self, worker: _Worker, students: list[str]) -> dict:
        answer = worker.ask({"op": "finish", "students": students}, 120 + 5 * len(students))
        return answer or {"ok": False, "error": "the worker stopped answering", "log": worker.log_tail()}


class _Worker:
    """A child Python running nbgrader (``worker_main``), asked one JSON request at a time over a pipe.
    Its own stdout and stderr go to a log file; the kernels it starts cannot reach the pipes."""

    def __init__(self, course: Course, index: int):
        self.course, self.index = course, index
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        self.log_path = course.aux / "logs" / f"worker-{index}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from gpucourse.grading.worker import worker_main; worker_main()", str(course.spec),
                 str(cmd_r), str(res_w)],
                pass_fds=(cmd_r, res_w), cwd=course.root, env=course.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(cmd_r)
        os.close(res_w)
        self.cmd = os.fdopen(cmd_w, "w", buffering=1)
        self.res = res_r
        self.buffer = b""
        self.asked = 0

    def ask(self, request: dict, timeout: float) -> dict | None:
        """The worker's answer to ``request``, or None when it gave none within ``timeout`` seconds or died.
        Answers carry the request's number, so a late answer to an earlier request is never taken for this one."""
        self.asked += 1
        try:
            self.cmd.write(json.dumps({**request, "id": self.asked}) + "\n")
            self.cmd.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ready, _, _ = select.select([self.res], [], [], min(left, 1.0))
                if ready:
                    chunk = os.read(self.res, 1 << 20)
                    if not chunk:
                        return None
                    self.buffer += chunk
                elif self.proc.poll() is not None:
                    return None
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                continue
            if answer.get("id") == self.asked:
                return answer

    def log_tail(self) -> str:
        try:
            return "\n" + tail(self.log_path.read_text(errors="replace"), 40)
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None and not kill:
            with contextlib.suppress(OSError, ValueError):
                self.cmd.write('{"op": "quit"}\n')
                self.cmd.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for closing in (self.cmd.close, lambda: os.close(self.res)):
            with contextlib.suppress(OSError, ValueError):
                closing()


def report_from(answer: dict, learner: Path, assignment: str) -> GradeReport:
    r = answer["report"]
    return GradeReport(notebook=str(learner), assignment=assignment, mode=r["mode"],
                       tests=[TestResult(**t) for t in r["tests"]], notes=list(r["notes"]),
                       seconds=float(answer.get("seconds", 0.0)))
