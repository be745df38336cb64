"""Lesson 5's graded exercises through the real grader: the solution earns every point CPU mode can grade, the
released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU mode
(Task 5.2's kernel in the simulator), where the GPU-only speed test (perf_5_2_speed) is "not gradable here"; its
GPU side is checked by running the solution notebook on a GPU (python -m gpucourse run ... --mode gpu)."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson05, pytest.mark.slow]


def no_dilation(nb):
    """Task 5.1: the filter's span without the dilation: right for every undilated layer."""
    replace_in_cell(nb, "task-5-1-size", "span = dilation * (r - 1) + 1", "span = r")


def flipped_filter(nb):
    """Task 5.2: the textbook convolution (filter flipped) instead of deep learning's cross-correlation."""
    replace_in_cell(nb, "task-5-2-kernel", "acc[j] += v * w[k0 + j, r, s, c]",
                    "acc[j] += v * w[k0 + j, R - 1 - r, S - 1 - s, c]")


def no_relu(nb):
    """Task 5.2: the bias added, the ReLU forgotten."""
    replace_in_cell(nb, "task-5-2-kernel", "y[n, p, q, k0 + j] = max(acc[j] + b[k0 + j], np.float32(0.0))",
                    "y[n, p, q, k0 + j] = acc[j] + b[k0 + j]")


def taps_outermost(nb):
    """Task 5.3: rows ordered (r, s, c), as NHWC's im2col orders its columns, instead of (c, r, s)."""
    replace_in_cell(nb, "task-5-3-im2col", "return cols.reshape(n, c * r * s, P * Q)",
                    "return cols.transpose(0, 2, 3, 1, 4, 5).reshape(n, c * r * s, P * Q)")


def trusts_failed_rows(nb):
    """Task 5.4 (a): the status ignored, so an algorithm that failed can win. (b) still uses the right
    function's answers on the recorded table, whose failed rows carry no time."""
    replace_in_cell(nb, "task-5-4-choose", 'ok = [row for row in table if row["status"] == "CUDNN_STATUS_SUCCESS"\n'
                    '          and (limit is None',
                    'ok = [row for row in table if row["time_ms"] is not None\n          and (limit is None')


def strict_limit(nb):
    """Task 5.4 (a): workspace strictly below the limit: an algorithm needing exactly the limit is refused."""
    replace_in_cell(nb, "task-5-4-choose", 'row["workspace_bytes"] <= limit', 'row["workspace_bytes"] < limit')


def fastest_for_no_workspace(nb):
    """Task 5.4 (b): the fastest algorithm overall given as the one to use with no workspace: (a) is right, and the
    visible test of (b) sees that it needs workspace."""
    replace_in_cell(nb, "task-5-4-answers", "algo_no_workspace = choose_algorithm(TABLE, 0)",
                    "algo_no_workspace = choose_algorithm(TABLE, None)")


def gemm_reads_no_cols(nb):
    """Task 5.5 (a): the im2col route's GEMM counted without reading the cols matrix back: (b) is consistent with
    it, and wrong against the model."""
    replace_in_cell(nb, "task-5-5-floor", "max((cols + w_bytes + y_bytes) * bytes_us, flops_us)",
                    "max((w_bytes + y_bytes) * bytes_us, flops_us)")


def im2col_ok_inverted(nb):
    """Task 5.5 (b): the layers where im2col + GEMM costs more than twice the implicit GEMM, not at most."""
    replace_in_cell(nb, "task-5-5-decision", "if ratio <= 2]", "if ratio > 2]")


def last_group_full(nb):
    """Task 5.2: every group taken as KPT channels wide: with K not a multiple of 4 the last group reads w and
    writes y past channel K - 1 (in the simulator, an index out of bounds)."""
    replace_in_cell(nb, "task-5-2-kernel", "kn = min(KPT, K - k0)", "kn = KPT")


class TestExercises(LessonExercises):
    LESSON = "05_convolution"
    NOTEBOOK = "convolution.ipynb"
    TIMEOUT = 60  # seconds per cell: Task 5.2's hidden cases in the simulator take a few
    POINTS = {"test_5_1_size": 2, "test_5_2_results": 3, "perf_5_2_speed": 2, "test_5_3_im2col": 3,
              "test_5_4_choose": 2, "test_5_4_answers": 2, "test_5_5_floor": 2, "test_5_5_decision": 2}
    VARIANTS = {
        no_dilation: ["test_5_1_size", "test_5_3_im2col"],  # Task 5.3's im2col uses output_size
        flipped_filter: ["test_5_2_results"],
        no_relu: ["test_5_2_results"],
        last_group_full: ["test_5_2_results"],
        taps_outermost: ["test_5_3_im2col"],
        trusts_failed_rows: ["test_5_4_choose"],
        strict_limit: ["test_5_4_choose", "test_5_4_answers"],  # with limit 0, nothing is below it
        fastest_for_no_workspace: ["test_5_4_answers"],
        gemm_reads_no_cols: ["test_5_5_floor", "test_5_5_decision"],
        im2col_ok_inverted: ["test_5_5_decision"],
    }
    UNANSWERED = {"test_5_1_size": "NotImplementedError", "test_5_3_im2col": "NotImplementedError",
                  "test_5_4_choose": "NotImplementedError", "test_5_5_floor": "NotImplementedError"}
    ANSWERS = ["dilation * (r - 1) + 1", 'row["workspace_bytes"] <= limit',
               "max(acc[j] + b[k0 + j]", "(x_bytes + cols) * bytes_us"]

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "want 28" in message("no_dilation", "test_5_1_size")  # a hidden test: 3 taps dilated by 2, pad 2
        assert "cross-correlation" in message("flipped_filter", "test_5_2_results")
        assert "ReLU is missing" in message("no_relu", "test_5_2_results")
        assert "c R S + i S + j" in message("taps_outermost", "test_5_3_im2col")
        assert "chose" in message("trusts_failed_rows", "test_5_4_choose")
        assert "bytes of workspace" in message("fastest_for_no_workspace", "test_5_4_answers")
