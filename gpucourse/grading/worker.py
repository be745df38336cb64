"""The worker: a child Python that runs nbgrader's generate_assignment and autograde for the grader, with
nbgrader's executor and score keeping replaced by guarded versions.

nbgrader 0.9 facts this module relies on
    * nbgrader's autograde executes the notebook in the folder it copies it to, restores locked cells and
      hidden tests from the gradebook, and scores with ``utils.determine_grade``, replaced here (``verdicts``).
    * Its ``add_missing_cells`` repair fails with a KeyError in 0.9.6 when the cell before a deleted one is
      gone too, or is not a test or solution cell; the repair step above makes it unnecessary.
    * When the kernel dies, its executor raises and autograde grades nothing; GuardedExecute catches it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from .. import runtime
from .course import course_config, tail
from .reports import number
from .settings import (
    COURSE_ID, KERNEL_NAME, Limits, NOT_GRADABLE_STATUSES, TRACEBACK_LINES, VALUE_CHARS, WARNING_PATTERN)
from .submissions import prepare_submission, read_notebook
from .verdicts import clip_text, first_lines, as_text, cell_verdict


def guarded_config(limits: Limits) -> dict:
    """nbgrader settings of the worker (the guarded preprocessors are set in ``worker_main``)."""
    return {
        "Execute": {"timeout": limits.timeout, "interrupt_on_timeout": True, "kernel_name": KERNEL_NAME,
                    "iopub_timeout": 5, "raise_on_iopub_timeout": True, "shutdown_kernel": "immediate",
                    "skip_cells_with_tag": "gpucourse-never-skip"},
        "IgnorePattern": {"enabled": True, "pattern": WARNING_PATTERN},
        # nbgrader leaves autograded notebooks read-only (444) by default; the worker then writes its verdicts
        # into them, which only root could do. The owner keeps write access.
        "Autograde": {"create_student": True, "permissions": 644},
        "LimitOutput": {"max_lines": 1000, "max_traceback": TRACEBACK_LINES},
        "Application": {"log_level": "WARN"},
    }


_RUN: dict = {}  # the notebook being autograded in this worker: its limits, mode and per-cell events


def worker_main() -> None:
    """The worker: read one JSON request a line from the command pipe, answer one JSON line on the result
    pipe. Requests: generate; grade {student, path}; finish {students}; ready; quit."""
    spec_path, cmd_fd, res_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(spec_path).read_text())
    commands = os.fdopen(cmd_fd, "r")
    results = os.fdopen(res_fd, "w", buffering=1)
    import logging
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    from nbgrader.apps.api import NbGraderAPI
    from nbgrader.preprocessors import AssignLatePenalties, CheckCellMetadata, IgnorePattern, LimitOutput
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from traitlets.config import Config

    guarded_execute, guarded_save = guarded_preprocessors()
    config = Config(spec["config"])
    config.Autograde.autograde_preprocessors = [guarded_execute, IgnorePattern, ClearMetadataPreprocessor,
                                                LimitOutput, guarded_save, AssignLatePenalties, CheckCellMetadata]
    api = NbGraderAPI(config=config)
    limits = Limits(**spec["limits"])
    _RUN.update(limits=limits, mode=spec["mode"])

    def generate(request):
        r = api.generate_assignment(spec["assignment"], force=True, create=True)
        return {"ok": bool(r["success"]), "error": _why_failed(r), "log": r.get("log", "")}

    def grade(request):
        return _worker_grade(api, spec, request["student"], Path(request["path"]))

    def finish(request):
        return _worker_finish(api, spec, request["students"])

    handlers = {"generate": generate, "grade": grade, "finish": finish, "ready": lambda r: {"ok": True}}
    for line in commands:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            answer = handlers[request["op"]](request)
        except Exception as exc:  # noqa: BLE001 - answer, do not die: the parent decides
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "log": traceback.format_exc()}
        results.write(json.dumps({**answer, "id": request.get("id")}) + "\n")


def _why_failed(result: dict) -> str:
    if result.get("success"):
        return ""
    log = as_text(result.get("log", "")) + "\n" + as_text(result.get("error", ""))
    errors = [line.strip() for line in log.splitlines() if re.match(r"\s*[\w.]+(Error|Exception): ", line)]
    return next((e for e in reversed(errors) if "see the the above traceback" not in e), tail(log, 3) or "see the log")


# What nbclient raises when the kernel it started exits before answering its first request: no cell of the
# submission has run, so grading again is safe; a kernel that fails to start twice is the grader's fault, reported.
KERNEL_START_FAILURE = re.compile(r"died before replying to kernel_info", re.I)


def _autograde(api, assignment: str, student: str) -> dict:
    """nbgrader's autograde of one submission, once more if its kernel died before running anything (seen in
    classes graded on 2 cores). The retry is the grader's affair, not the learner's: it goes to the worker's log
    (stderr), not into the report."""
    _RUN["events"] = {}
    r = api.autograde(assignment, student, force=True, create=True)
    if r["success"] or not KERNEL_START_FAILURE.search(as_text(r.get("log", "")) + as_text(r.get("error", ""))):
        return r
    print(f"grading {student}/{assignment}: the kernel died before replying to kernel_info (no cell ran); "
          "grading again", file=sys.stderr, flush=True)
    _RUN["events"] = {}
    return api.autograde(assignment, student, force=True, create=True)


def _worker_grade(api, spec: dict, student: str, raw: Path) -> dict:
    """Repair and check one submission, autograde it, and build its report (as a dict)."""
    root, assignment, name = Path(spec["root"]), spec["assignment"], spec["notebook"]
    started = time.monotonic()
    try:
        learner = read_notebook(raw)
        source = json.loads((root / "source" / assignment / f"{name}.ipynb").read_text(encoding="utf-8"))
        release_path = root / "release" / assignment / f"{name}.ipynb"
        release = json.loads(release_path.read_text(encoding="utf-8")) if release_path.is_file() else None
        nb, notes = prepare_submission(learner, source, release)
    except runtime.CourseInputError as exc:
        message = str(exc)
        return {"ok": False, "error": message if message.startswith(f"{name}.ipynb") else f"{name}.ipynb: {message}"}
    folder = root / "submitted" / student / assignment
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / f"{name}.ipynb").write_text(json.dumps(nb, indent=1), encoding="utf-8")
    r = _autograde(api, assignment, student)
    graded = root / "autograded" / student / assignment / f"{name}.ipynb"
    if not r["success"] or not graded.is_file():
        return {"ok": False, "error": f"nbgrader autograde failed: {_why_failed(r)}", "log": r.get("log", "")}
    report = _worker_report(root, assignment, name, student, spec["mode"], _RUN["events"])
    report["notes"] = notes + report["notes"]
    _annotate(graded, report["tests"])
    return {"ok": True, "report": report, "seconds": time.monotonic() - started}


def _worker_report(root: Path, assignment: str, name: str, student: str, mode: str, events: dict) -> dict:
    from nbgrader.api import Gradebook

    graded = root / "autograded" / student / assignment / f"{name}.ipynb"
    cells = json.loads(graded.read_text(encoding="utf-8"))["cells"]
    with Gradebook(course_config(root)["CourseDirectory"]["db_url"], course_id=COURSE_ID) as gb:
        sub = gb.find_submission_notebook(name, assignment, student)
        grades = {g.name: (g.score, float(g.max_score), bool(g.needs_manual_grade)) for g in sub.grades}
    tests, notes = [], []
    for index, cell in enumerate(cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        grade_id = meta.get("grade_id")
        if not meta.get("grade") or grade_id not in grades:
            continue
        score, max_score, manual = grades.pop(grade_id)
        _, status, message = cell_verdict(cell, max_score, mode, events.get(index))
        if manual:
            status, message = "needs manual grading", ""
        tests.append({"grade_id": grade_id, "points": float(score or 0.0), "max_points": max_score,
                      "status": status, "message": message})
    for grade_id, (score, max_score, _) in grades.items():  # in the gradebook but not in the notebook
        tests.append({"grade_id": grade_id, "points": float(score or 0.0), "max_points": max_score,
                      "status": "failed", "message": "the cell is missing from the notebook"})
    for index, cell in enumerate(cells):  # what happened in the cells that are not tests
        if cell.get("cell_type") != "code" or cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            continue
        stop = events.get(index)
        if stop and stop[0] in ("kernel died", "timed out"):
            notes.append(f"cell {_cell_label(cell, index)}: {stop[1]}")
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and out.get("ename") == "PermissionError" and \
                    as_text(out.get("evalue")).startswith("the grader ") and \
                    not as_text(out.get("evalue")).startswith("the grader did not run"):
                notes.append(f"cell {_cell_label(cell, index)}: PermissionError: {first_lines(out['evalue'], 1)}")
    return {"mode": mode, "tests": tests, "notes": notes}


def _cell_label(cell: dict, index: int) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or f"{index + 1} (one you added)"


def _annotate(graded: Path, tests: list[dict]) -> None:
    """End every graded cell of the autograded notebook with the grader's verdict, for the feedback HTML."""
    nb = json.loads(graded.read_text(encoding="utf-8"))
    verdicts = {t["grade_id"]: t for t in tests}
    for cell in nb["cells"]:
        t = verdicts.get(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id"))
        if t is None or cell.get("cell_type") != "code":
            continue
        got = "-" if t["status"] in NOT_GRADABLE_STATUSES else number(t["points"])
        detail = t["status"] if t["message"] in ("", t["status"]) else f"{t['status']}: {t['message']}"
        cell.setdefault("outputs", []).append({"output_type": "stream", "name": "stdout",
                                               "text": f"grader: {got} / {number(t['max_points'])}, {detail}\n"})
    graded.write_text(json.dumps(nb, indent=1), encoding="utf-8")


def _worker_finish(api, spec: dict, students: list[str]) -> dict:
    """nbgrader's feedback HTML for every graded student, and its CSV export of the gradebook."""
    from nbgrader.api import Gradebook
    from nbgrader.plugins.export import CsvExportPlugin

    root, assignment = Path(spec["root"]), spec["assignment"]
    log = []
    for student in students:
        r = api.generate_feedback(assignment, student, force=True)
        log.append(r.get("log", ""))
        if not r["success"]:
            return {"ok": False, "error": f"feedback for {student}: {_why_failed(r)}", "log": "\n".join(log)}
    with Gradebook(course_config(root)["CourseDirectory"]["db_url"], course_id=COURSE_ID) as gb:
        CsvExportPlugin(to=str(root / "grades.csv")).export(gb)
    return {"ok": True, "csv": str(root / "grades.csv")}


def guarded_preprocessors():
    """nbgrader's executor and score keeper with the grader's limits and rules (defined here, in the
    worker, because they subclass nbgrader's classes)."""
    import nbformat
    from nbclient.client import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from nbgrader.preprocessors import Execute, SaveAutoGrades

    from ..jupyter import CourseKernelManager

    def error_output(ename: str, evalue: str) -> dict:
        return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])

    class GuardedExecute(Execute):
        """Execute with a notebook time limit, output caps, and a dead or stuck kernel reported per cell."""

        def preprocess(self, nb, resources=None, km=None):
            limits: Limits = _RUN["limits"]
            events: dict = _RUN.setdefault("events", {})
            NotebookClient.__init__(self, nb, km)
            self.kernel_manager_class = CourseKernelManager  # IPC: no "running over TCP without encryption"
            self.reset_execution_trackers()
            self._check_assign_resources(resources)
            self.kernel_name = KERNEL_NAME  # whatever kernel the notebook's metadata names
            self.skip_cells_with_tag = "gpucourse-never-skip"
            self._chars = {"cell": 0, "notebook": 0, "noted": set()}
            deadline = time.monotonic() + limits.notebook_timeout
            stop = None
            with self.setup_kernel():
                info = self.wait_for_reply(self.kc.kernel_info())
                self.nb.metadata["language_info"] = info["content"]["language_info"]
                for index, cell in enumerate(self.nb.cells):
                    if cell.cell_type != "code" or not cell.source.strip():
                        continue
                    left = deadline - time.monotonic()
                    if stop is None and left < 1:
                        stop = f"the notebook used up its limit of {limits.notebook_timeout} s before this cell"
                    if stop is not None:
                        cell.outputs = [error_output("NotRun", stop)]
                        events[index] = ("not run", stop)
                        continue
                    timeout = int(max(1, min(limits.timeout, left)))
                    self.timeout_func = lambda _cell, t=timeout: t
                    self._chars["cell"], self._chars["noted"] = 0, set()
                    self._timed_out = False
                    try:
                        self.preprocess_cell(cell, resources, index)
                    except DeadKernelError:
                        how = self._exit_status()
                        events[index] = ("kernel died", f"the kernel died while this cell ran ({how}); the cells "
                                         "after it were not run. Restart the kernel and run all cells to find the "
                                         "line that ends it")
                        cell.outputs.append(error_output("KernelDied", events[index][1]))
                        stop = f"the kernel died in an earlier cell ({how})"
                    except CellTimeoutError:
                        events[index] = ("timed out", f"no result within {timeout} s, and the cell did not stop "
                                         "when interrupted; the cells after it were not run")
                        cell.outputs.append(error_output("CellTimeoutError", events[index][1]))
                        stop = "an earlier cell could not be interrupted"
                    except Exception as exc:  # noqa: BLE001 - a grader failure on one cell, not the notebook
                        events[index] = ("failed", f"the grader could not run this cell ({type(exc).__name__}: "
                                         f"{first_lines(str(exc), 1, 200)}); the cells after it were not run")
                        cell.outputs.append(error_output("GraderError", events[index][1]))
                        stop = "the grader could not run an earlier cell"
                    else:
                        if self._timed_out:
                            why = (f"; the notebook's limit of {limits.notebook_timeout} s was reached"
                                   if timeout < limits.timeout else "")
                            events[index] = ("timed out", f"no result within {timeout} s; the cell was "
                                             f"interrupted{why}")
                    if stop is not None:
                        self.shutdown_kernel = "immediate"
            self.set_widgets_metadata()
            return self.nb, self.resources

        async def _async_handle_timeout(self, timeout, cell=None):
            self._timed_out = True
            return await super()._async_handle_timeout(timeout, cell)

        def _exit_status(self) -> str:
            process = getattr(getattr(self.km, "provisioner", None), "process", None)
            code = None
            if process is not None:
                with contextlib.suppress(Exception):
                    code = process.wait(timeout=5)
            return _describe_exit(code)

        def output(self, outs, msg, display_id, cell_index):
            out = super().output(outs, msg, display_id, cell_index)
            if out is None:
                return None
            limits: Limits = _RUN["limits"]
            kind = out.get("output_type")
            if kind == "error":
                out["evalue"] = clip_text(str(out.get("evalue", "")), 4000)
                tb = list(out.get("traceback", []))
                out["traceback"] = tb[:TRACEBACK_LINES] + ([f"... {len(tb) - TRACEBACK_LINES} more lines"]
                                                           if len(tb) > TRACEBACK_LINES else [])
                return out
            if kind == "execute_result":
                data = out.get("data", {})
                plain = clip_text(as_text(data.get("text/plain", "")), VALUE_CHARS)
                out["data"] = {"text/plain": plain} if _output_chars(out) > VALUE_CHARS * 2 else data
                return out
            size = _output_chars(out)
            budget = min(limits.cell_output_chars - self._chars["cell"],
                         limits.notebook_output_chars - self._chars["notebook"])
            if size <= budget:
                self._chars["cell"] += size
                self._chars["notebook"] += size
                return out
            stream = out.get("name") if kind == "stream" else "stdout"
            if kind == "stream" and budget > 0:
                out["text"] = as_text(out.get("text"))[:budget]
                self._chars["cell"] += budget
                self._chars["notebook"] += budget
            elif display_id:
                out["data"] = {"text/plain": "[output dropped by the grader]"}
            elif outs and outs[-1] is out:
                outs.pop()
            if stream not in self._chars["noted"]:
                self._chars["noted"].add(stream)
                whose = ("this cell" if limits.cell_output_chars - self._chars["cell"] <= 0 else "this notebook")
                outs.append(nbformat.v4.new_output(
                    "stream", name=stream, text=f"\n[... output truncated: the grader keeps at most "
                    f"{min(limits.cell_output_chars, limits.notebook_output_chars)} characters of {whose}'s "
                    "output]\n"))
            return out

    class GuardedSaveAutoGrades(SaveAutoGrades):
        """SaveAutoGrades scoring with ``cell_verdict`` instead of nbgrader's determine_grade."""

        def preprocess_cell(self, cell, resources, cell_index):
            self._index = cell_index
            return super().preprocess_cell(cell, resources, cell_index)

        def _add_score(self, cell, resources):
            grade = self.gradebook.find_grade(cell.metadata["nbgrader"]["grade_id"], self.notebook_id,
                                              self.assignment_id, self.student_id)
            points, _, _ = cell_verdict(cell, float(cell.metadata["nbgrader"]["points"]), _RUN["mode"],
                                    _RUN.get("events", {}).get(self._index))
            grade.auto_score = points
            grade.needs_manual_grade = grade.manual_score is not None or points is None
            self.gradebook.db.commit()

    return GuardedExecute, GuardedSaveAutoGrades


def _describe_exit(code) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"killed by signal {-code}"
        what = {signal.SIGSEGV: "a segmentation fault", signal.SIGKILL: "killed, often for running out of memory",
                signal.SIGABRT: "aborted", signal.SIGBUS: "a bus error", signal.SIGFPE: "a floating-point exception",
                signal.SIGXFSZ: "a file grew past its limit"}.get(sig)
        return f"{sig.name}" + (f": {what}" if what else "")
    return f"exit code {code}"


def _output_chars(out) -> int:
    if out.get("output_type") == "stream":
        return len(as_text(out.get("text")))
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in (out.get("data") or {}).values())
