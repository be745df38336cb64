"""python -m gpucourse COMMAND — the course's command line.

  probe [--cc 7.5]      GPU or CPU mode, what the GPU is, and which lesson steps it runs (or a GPU of --cc)
  lab                   open the course in JupyterLab (with --allow-root when run as root)
  run [NB ...]          execute lesson and solution notebooks headless; print a summary (and, for a notebook
                        with tests, each test by name: pass or FAIL, with the failing assertion's message)
  matrix [--cc 7.5 8.0 8.6 8.9 native] [--jobs N] [--save DIR] [NB ...]
                        on a GPU: every notebook in GPU mode at each compute capability (GPUCOURSE_FAKE_CC);
                        a table notebook x capability, pass/FAIL and seconds
  record [LESSON ...]   on a GPU: run lessons' benchmarks, write results/<gpu>/<lesson>.json
                        (--figure NAME: re-measure one figure into the newest record of this GPU)
  ceilings [--refresh]  this GPU's measured copy, transfer and GEMM ceilings
  grade NB              grade one exercise notebook with nbgrader; print the score and feedback
  grade-class FOLDER    autograde a class's submissions into nbgrader's gradebook; CSV and feedback HTML
  exercises [--check]   generate exercises/ from solutions/ (or check they are in sync)
  check-records         check the committed GPU records in results/ (complete, every declared figure held,
                        each lesson's checks of its recorded figures: the tests marked "records")
  results [--check]     write RESULTS.md, every record's headline figures, from results/ (or check it and the
                        figures the README quotes)
  hub --instructor NAME [--students A,B,...]
                        as root: a JupyterHub for a class, with nbgrader's exchange (Ctrl-C stops it)
  release-feedback LESSON
                        hand grade-class's feedback to nbgrader's exchange; students fetch their own
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import runtime

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpucourse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--mode", choices=["auto", "gpu", "cpu"], default=None, help="force GPU or CPU mode")
    sub = p.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", parents=[common])
    probe.add_argument("--cc", help="say what a GPU of this compute capability runs (e.g. 7.5 for a T4)")
    sub.add_parser("lab", help="further options go to jupyter lab")
    run = sub.add_parser("run", parents=[common])
    run.add_argument("notebooks", nargs="*", type=Path)
    run.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    run.add_argument("--save", type=Path, help="write executed copies here")
    mat = sub.add_parser("matrix", parents=[common],
                         help="on a GPU: every notebook at each compute capability a learner's GPU may have")
    mat.add_argument("notebooks", nargs="*", type=Path, help="default: every lesson, deep dive and solution notebook")
    mat.add_argument("--cc", nargs="+", metavar="CC", help="compute capabilities to fake, and 'native' for the GPU's "
                                                           "own (default: 7.5 8.0 8.6 8.9 native)")
    mat.add_argument("--jobs", type=int, default=1, help="notebooks run at a time, each in its own kernel (default 1)")
    mat.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    mat.add_argument("--save", type=Path, help="write the executed copies and matrix.json here")
    rec = sub.add_parser("record", parents=[common])
    rec.add_argument("lessons", nargs="*")
    rec.add_argument("--figure", help="re-measure only this figure of one lesson and add it to that lesson's newest "
                                      "record on this GPU (stamped with when it was measured)")
    ceil = sub.add_parser("ceilings", parents=[common])
    ceil.add_argument("--refresh", action="store_true")
    grade = sub.add_parser("grade", parents=[common])
    grade.add_argument("notebook", type=Path)
    grade.add_argument("--timeout", type=int, help="seconds each cell may run (default 120)")
    grade.add_argument("--json", action="store_true", help="print the report as JSON")
    # grade-class: a class's submissions, nbgrader's gradebook, CSV export and feedback (grading.grade_class)
    klass = sub.add_parser("grade-class", parents=[common],
                           help="autograde FOLDER/<student>/<assignment>/<notebook>.ipynb into a gradebook")
    klass.add_argument("folder", type=Path)
    klass.add_argument("--assignment", help="the lesson, e.g. 01_vector_multiply (default: the folder's)")
    klass.add_argument("--course-dir", type=Path, help="nbgrader course directory to write (default .grading/<lesson>)")
    klass.add_argument("--timeout", type=int, help="seconds each cell may run (default 120)")
    klass.add_argument("--notebook-timeout", type=int, help="seconds all cells of a notebook may run (default 600)")
    klass.add_argument("--workers", type=int, help="notebooks graded at a time (default 2)")
    klass.add_argument("--json", action="store_true", help="print the reports as JSON (progress goes to stderr)")
    sub.add_parser("check-records")
    res = sub.add_parser("results", help="write RESULTS.md from the records in results/")
    res.add_argument("--check", action="store_true",
                     help="only check that RESULTS.md and the README's quoted figures agree with the records")
    ex = sub.add_parser("exercises")
    ex.add_argument("--check", action="store_true", help="only check that exercises/ is in sync")
    # hub: the classroom route (gpucourse.classroom, README "Classroom on JupyterHub")
    hub = sub.add_parser("hub", help="as root: start a JupyterHub for a class (Ctrl-C stops it)")
    hub.add_argument("--instructor", action="append", default=[], help="an instructor's user name (repeatable)")
    hub.add_argument("--students", default="", help="comma-separated user names allowed to log in")
    hub.add_argument("--group", help="or: every member of this system group may log in")
    hub.add_argument("--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    hub.add_argument("--port", type=int, default=8000)
    hub.add_argument("--runtime", type=Path, help="the hub's private folder (default .hub/)")
    hub.add_argument("--exchange", type=Path, help="nbgrader's exchange (default /srv/nbgrader/exchange)")
    hub.add_argument("--api-token-file", type=Path, help="a file holding an API token for the course-admin service")
    hub.add_argument("--course-code", help="PYTHONPATH for users' servers: where gpucourse, kernels, benchmarks are")
    hub.add_argument("--mode", choices=["gpu", "cpu"], help="GPUCOURSE_MODE for users' servers (default: each decides)")
    fb = sub.add_parser("release-feedback", help="release grade-class's feedback through nbgrader's exchange")
    fb.add_argument("assignment")
    fb.add_argument("--course-dir", type=Path, help="the nbgrader course directory (default: the repository)")
    fb.add_argument("--graded", type=Path, help="grade-class's course directory (default .grading/LESSON)")
    args, extra = p.parse_known_args(argv)
    if extra and args.command != "lab":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.args = extra
    args.mode = getattr(args, "mode", None)

    try:
        return COMMANDS[args.command](args)
    except runtime.CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _probe(args) -> int:
    from . import records

    from . import gpus

    runtime.setup(args.mode, quiet=True)
    print(records.describe())
    cc = runtime.parse_cc(args.cc) if args.cc else runtime.compute_capability()
    if cc is None:
        print("No GPU here to run CUDA C; `python -m gpucourse probe --cc 7.5` says what a T4 would run "
              f"(the course supports compute capability {', '.join(f'{a}.{b}' for a, b in gpus.GPUS)}).")
    else:
        print(gpus.summary(cc if args.cc else None))
    return 0


def lab_command(extra: list, *, euid: int | None = None, settings: Path | None = None) -> tuple[list, str | None]:
    """The command that opens JupyterLab, and a line to print about it (or None). As root (Docker, cloud
    images) Jupyter refuses to start without --allow-root, so it is added. ``settings``: an application settings
    folder (``jupyter.write_lab_settings``: no news prompt), unless ``extra`` names one."""
    cmd = [sys.executable, "-m", "jupyter", "lab", *extra]
    if settings is not None and not any(a.startswith("--LabApp.app_settings_dir") for a in extra):
        from . import jupyter

        cmd += jupyter.lab_arguments(settings)
    euid = os.geteuid() if euid is None else euid
    if euid == 0 and "--allow-root" not in extra:
        return [*cmd, "--allow-root"], "Running as root: starting JupyterLab with --allow-root."
    return cmd, None


def _lab(args) -> int:
    import shutil
    import tempfile

    from . import jupyter

    folder = Path(tempfile.mkdtemp(prefix="gpucourse-lab-"))
    try:
        cmd, note = lab_command(args.args, settings=jupyter.write_lab_settings(folder / "settings"))
        if note:
            print(note, flush=True)
        return subprocess.call(cmd, cwd=ROOT)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(args) -> int:
    from . import notebooks

    mode = args.mode if args.mode in ("gpu", "cpu") else runtime.setup(quiet=True).mode
    paths = args.notebooks or notebooks.lesson_notebooks()
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise runtime.CourseInputError(f"no notebook at {', '.join(missing)}")
    outcomes = []
    for path in paths:
        print(f"running {path} in {mode.upper()} mode ...", flush=True)
        outcome = notebooks.execute(path, mode=mode, timeout=args.timeout, save_to=args.save)
        if outcome.tested:  # an exercise or a solution: its tests, as the grader scores them
            hint = "" if notebooks.has_hidden_tests(path) else (
                f"These are the notebook's visible tests: `python -m gpucourse grade {path}` adds the hidden tests "
                "and gives your score.")
            print(outcome.report().checklist(hint) + ("\n" + outcome.error if outcome.error else "") + "\n",
                  flush=True)
        outcomes.append(outcome)
    print(notebooks.summary(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


def _matrix(args) -> int:
    from . import matrix

    ccs = list(args.cc or [])
    args.notebooks += [Path(c) for c in ccs if c.endswith(".ipynb")]  # `--cc 7.5 NB`: the notebook is no capability
    ccs = [c for c in ccs if not c.endswith(".ipynb")]
    return matrix.matrix_cli(args.notebooks, ccs, jobs=args.jobs, timeout=args.timeout, save=args.save, mode=args.mode)


def _record(args) -> int:
    import benchmarks
    from . import records

    runtime.setup(args.mode or "gpu")
    if args.figure:
        if len(args.lessons) != 1 or args.lessons[0] not in benchmarks.LESSONS:
            raise runtime.CourseInputError(f"--figure needs exactly one lesson; known: {', '.join(benchmarks.LESSONS)}")
        data = benchmarks.measure_one(args.lessons[0], args.figure)
        print(f"wrote {records.add_figure(args.lessons[0], args.figure, data)}")
        _rewrite_results()
        return 0
    have = runtime.gpu_count()
    for lesson in args.lessons or list(benchmarks.LESSONS):
        if lesson not in benchmarks.LESSONS:
            raise runtime.CourseInputError(f"no lesson {lesson!r}; known: {', '.join(benchmarks.LESSONS)}")
        needed = getattr(benchmarks.module(lesson), "GPUS", 1)
        if not args.lessons and have < needed:  # asked for by name, the lesson's own error says why
            print(f"skipped {lesson}: it needs {needed} GPUs and this machine has {have}")
            continue
        figures, ceilings = benchmarks.run(lesson)
        print(f"wrote {records.write(lesson, figures, ceilings=ceilings)}")
    _rewrite_results()
    return 0


def _rewrite_results() -> None:
    """After recording into the repository's results/: RESULTS.md again, and whether the README's figures hold."""
    from . import records, results

    if records.results_dir().resolve() != (results.ROOT / "results").resolve():
        return  # GPUCOURSE_RESULTS elsewhere: RESULTS.md describes the repository's records
    print(f"wrote {results.write(results_registry())}")
    for p in results.check(results_registry()):
        print(f"  {p}")


def _ceilings(args) -> int:
    from . import bench

    runtime.setup(args.mode or "gpu")
    for key, value in bench.ceilings(refresh=args.refresh).as_dict().items():
        print(f"{key:20} {value:.1f}" if isinstance(value, float) else f"{key:20} {value}")
    return 0


def _grade(args) -> int:
    from . import grading

    mode = args.mode if args.mode in ("gpu", "cpu") else None  # None: the notebook's kernel decides
    return grading.grade_cli(args.notebook, mode=mode, timeout=args.timeout, as_json=args.json)


def _grade_class(args) -> int:
    from . import grading

    mode = args.mode if args.mode in ("gpu", "cpu") else None
    return grading.grade_class_cli(args.folder, assignment=args.assignment, course_dir=args.course_dir, mode=mode,
                                   timeout=args.timeout, notebook_timeout=args.notebook_timeout,
                                   workers=args.workers, as_json=args.json)


def _exercises(args) -> int:
    from . import grading

    return grading.exercises_cli(check=args.check)


def _hub(args) -> int:
    from . import classroom

    students = [s for s in args.students.replace(" ", ",").split(",") if s]
    return classroom.hub_cli(instructors=args.instructor, students=students, group=args.group, ip=args.ip,
                             port=args.port, runtime_dir=args.runtime, exchange=args.exchange,
                             api_token_file=args.api_token_file, course_code=args.course_code, mode=args.mode)


def _release_feedback(args) -> int:
    from . import classroom

    return classroom.release_feedback_cli(args.assignment, course_dir=args.course_dir, graded=args.graded)


def results_registry() -> dict:
    """{lesson: its benchmarks module's results_rows}: what RESULTS.md is written from (gpucourse.results)."""
    import benchmarks

    return {lesson: benchmarks.module(lesson).results_rows for lesson in benchmarks.LESSONS}


def _results(args) -> int:
    from . import results

    if not args.check:
        print(f"wrote {results.write(results_registry())}")
    problems = results.check(results_registry())
    for p in problems:
        print(p, file=sys.stderr)
    if not problems and args.check:
        print("RESULTS.md and the README's headline figures agree with the records")
    return 1 if problems else 0


def _check_records(args) -> int:
    import benchmarks
    from . import records

    problems = records.check_all({lesson: benchmarks.figures(lesson) for lesson in benchmarks.LESSONS})
    for lesson in benchmarks.LESSONS:
        gpus_ = sorted({r["gpu"]["name"] for r in records.all_records(lesson)})
        mine = [p for p in problems if p.startswith(lesson)]
        print(f"{lesson:22} {'ok' if not mine else 'PROBLEMS'}  ({', '.join(gpus_) or 'no record'})")
    for p in problems:
        print(f"  {p}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "records", "-p", "no:cacheprovider",
                           str(ROOT / "tests")], cwd=ROOT)
    return 1 if problems or done.returncode != 0 else 0


COMMANDS = {"probe": _probe, "check-records": _check_records, "lab": _lab, "run": _run, "matrix": _matrix,
            "record": _record, "ceilings": _ceilings,
            "grade": _grade, "grade-class": _grade_class, "exercises": _exercises, "hub": _hub,
            "release-feedback": _release_feedback, "results": _results}
