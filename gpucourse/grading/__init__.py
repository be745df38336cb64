"""Grading learner notebooks with nbgrader, one notebook or a whole class, and keeping the released
exercises in step with the solutions.

Layout
    solutions/NN_name/<nb>.ipynb   nbgrader *source* notebooks: solutions between ``### BEGIN SOLUTION`` and
                                   ``### END SOLUTION``, hidden tests between ``### BEGIN HIDDEN TESTS`` and
                                   ``### END HIDDEN TESTS``, test cells marked as graded with their points.
    exercises/NN_name/<nb>.ipynb   the release nbgrader generates from them (``generate_exercises``); never
                                   edited by hand, and ``check_exercises`` proves it matches the solutions.

Grading
    ``grade(path)`` grades one notebook, ``grade_class(folder)`` a folder of submissions (nbgrader's
    ``submitted/<student>/<assignment>/<nb>.ipynb`` layout); both run the same steps:

    1. The submission is *repaired* (``prepare_submission``): the exercise's cells are put back in the
       source's order; locked cells (tests, read-only helpers) come from the source whatever the learner did
       to them (edited, deleted, duplicated, retyped, renamed); a deleted answer cell becomes one that raises
       NotImplementedError; cells the learner added keep their place after the cell they followed; forged
       nbgrader metadata is dropped. Every repair is a note in the report.
    2. Every cell the learner wrote is checked against the *integrity rules* (``integrity_findings``) before
       anything runs. A cell that breaks one is not run: it is replaced by one that raises PermissionError
       naming the line and the rule, so the tests that need it fail, and the rest are graded as usual.
    3. nbgrader's own generate_assignment and autograde run in a child Python (``worker_main``) in a
       throwaway course directory, with its real SQLite gradebook. The notebook runs in a *guarded kernel*
       (``kernel_main``), and nbgrader's executor and score keeping are replaced by guarded versions
       (GuardedExecute and GuardedSaveAutoGrades in ``guarded_preprocessors``), which enforce the limits (``settings``).
    4. Scores come from that gradebook; each test's message from the autograded notebook (``cell_verdict``).
       For a class, the gradebook also gives nbgrader's CSV export and its feedback HTML, in which every
       graded cell ends with the grader's one-line verdict.

Three processes, each started by the one above it, each wait bounded:

    grader (grade / grade_class; this process)
      | repairs and checks each submission (prepare_submission, integrity_findings), keeps the report
      | starts and feeds ------------------------------------------------------------------------------+
      v                                                                                               |
    worker: a child Python (worker_main, pool.Course)                  a JSON request per notebook    |
      | runs nbgrader's generate_assignment and autograde in a         in on its stdin, a JSON reply  |
      | throwaway course directory, with guarded preprocessors         out; time-outs per notebook,   |
      | (GuardedExecute, GuardedSaveAutoGrades)                        a worker that stops answering  |
      | starts, per notebook, through jupyter_client -------------+    is killed and replaced         |
      v                                                           |                                   |
    guarded kernel (kernel_main): runs the learner's cells        Jupyter's messages (ZeroMQ);        |
      on a copy of the course's code, under an audit hook         time-outs per cell and per          |
      (reads only its own and the system's folders, writes only   notebook; the kernel stops with     |
      its own, starts no process, opens no socket)                its notebook                        |
                                                                                                      |
    The report goes back up the same way: scores from the gradebook, each test's message (cell_verdict).

Rooms, each a floor above the ones it imports (nothing imports upwards):
    text         the small text helpers every room uses (as_text, first_lines, tail, number)
    settings     paths, limits (``Limits``), the messages for what cannot be graded here
    reports      ``TestResult``, ``GradeReport``, ``ClassReport``
    integrity    the rules a learner's cell must keep (``integrity_findings``)
    submissions  reading a submission and repairing it against its source
    verdicts     one graded cell's score and one-line message (``cell_verdict``)
    course       solutions/ as nbgrader sees it; the throwaway course directory and its configuration
    worker       the child Python that runs nbgrader (``worker_main``) with guarded preprocessors
    pool         the grader's side of the workers: the course copy, the guarded kernelspec, the pool
    kernel       the guarded kernel a graded notebook runs in, and its audit hook (``kernel_main``)
    performance  performance points and their clocks (``performance_points``); tests this machine cannot grade
                 (``gpus_missing``, ``needs_gpus``, ``step_missing``, ``software_missing``)
    autograde    ``grade`` and ``grade_class``
    exercises    ``generate_exercises`` and ``check_exercises``
    cli          ``python -m gpucourse grade | grade-class | exercises``
"""
from .settings import (CPU_PERF_MESSAGE, EXERCISES, GPUS_MESSAGE, GPUS_PERF_MESSAGE, NOT_GRADABLE, NOT_GRADABLE_ARCH,
                       NOT_GRADABLE_GPUS, NOT_GRADABLE_SOFTWARE, PERF_PREFIX, REPO, SOFTWARE_MESSAGE, SOLUTIONS,
                       STEP_PERF_MESSAGE, WARNING_PATTERN, GradingError, Limits)
from .reports import ClassReport, GradeReport, TestResult
from .performance import gpus_missing, needs_gpus, performance_points, performance_score, software_missing, step_missing
from .autograde import grade, grade_class
from .exercises import check_exercises, generate_exercises
from .cli import exercises_cli, grade_class_cli, grade_cli
from . import (autograde, cli, course, exercises, integrity, kernel, performance, pool, reports,  # noqa: F401  the rooms
               settings, submissions, verdicts, worker)

__all__ = ["grade", "grade_class", "performance_points", "performance_score", "gpus_missing", "step_missing",
           "software_missing", "needs_gpus", "GPUS_MESSAGE",
           "generate_exercises", "check_exercises", "GradeReport", "ClassReport", "TestResult", "GradingError",
           "Limits", "grade_cli", "grade_class_cli", "exercises_cli", "REPO", "SOLUTIONS", "EXERCISES", "PERF_PREFIX",
           "NOT_GRADABLE", "NOT_GRADABLE_GPUS", "NOT_GRADABLE_ARCH", "NOT_GRADABLE_SOFTWARE", "CPU_PERF_MESSAGE",
           "GPUS_PERF_MESSAGE", "SOFTWARE_MESSAGE",
           "STEP_PERF_MESSAGE", "WARNING_PATTERN"]
