"""nbgrader configuration for instructors; run nbgrader from the repository root.

    solutions/NN_name/*.ipynb     source notebooks: solutions, hidden tests, points
    exercises/NN_name/*.ipynb     the release learners get; regenerate with `python -m gpucourse exercises`
                                  (it runs `nbgrader generate_assignment`), never edit by hand
    submitted/<student>/NN_name/  collected work; autograded/, feedback/ and gradebook.db are written here
                                  too, and git ignores all four

Grading a whole class:
    nbgrader generate_assignment 01_vector_multiply --force   # fills gradebook.db (and rewrites exercises/)
    nbgrader autograde 01_vector_multiply --force
    nbgrader generate_feedback 01_vector_multiply

Grading one notebook needs none of this: `python -m gpucourse grade NB` (gpucourse/grading/) builds its
own course directory with the same settings. Run either in the mode the scores are meant for: GPU mode grades
the performance tests (grade_id perf_*), CPU mode (GPUCOURSE_MODE=cpu) gives them 0.
"""

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

c.CourseDirectory.course_id = "gpu-programming-for-deep-learning"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# Seconds a cell may run before it is interrupted and its test scores 0. CPU-mode cells take seconds; on a GPU
# a performance test times two kernels forty times each, well within this.
c.ExecutePreprocessor.timeout = 120

# A test cell a learner deleted is put back and graded, rather than left for manual grading. (nbgrader 0.9.6
# fails that notebook with a KeyError when the cell before the deleted one is gone too, or is not a test or
# solution cell; `python -m gpucourse grade` puts deleted cells back itself and is not affected.)
c.OverwriteCells.add_missing_cells = True

# nbgrader scores any stderr output in a test cell as a failure; drop output that is only a Python warning
# (a NumbaPerformanceWarning about a small grid, say). Keep in step with grading.WARNING_PATTERN.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"(?m)^\S.*:\d+: \w*Warning: "
