"""Lesson 6's graded exercises through the real grader: the solution earns every point CPU mode can grade, the
released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU
mode (Task 6.1's kernel in the simulator), where the two performance tests (perf_*) are "not gradable here";
their GPU side is checked by running the solution notebook on a GPU (python -m gpucourse run ... --mode gpu)."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson06, pytest.mark.slow]


def no_relu(nb):
    """Task 6.1: conv + bias + pool, the ReLU forgotten (the largest starts below every activation)."""
    replace_in_cell(nb, "task-6-1-kernel", "best = np.float32(0.0)  # the ReLU: nothing below zero survives",
                    "best = np.float32(-math.inf)")


def relu_in_a_second_pass(nb):
    """Task 6.1: right results, but the last activation is written to y and the window's largest found by reading
    it back: the memory pass fusion removes."""
    replace_in_cell(nb, "task-6-1-kernel", "        y[n, i, j, k] = best\n",
                    "        y[n, i, j, k] = acc\n        y[n, i, j, k] = max(y[n, i, j, k], best)\n")


def no_padding_check(nb):
    """Task 6.1: the window's edge test left out for columns: reads wrap into the neighbouring row, or fail past
    the last column."""
    replace_in_cell(nb, "task-6-1-kernel", "if 0 <= hh < H and 0 <= ww < W:", "if 0 <= hh < H:")


def mean_not_subtracted(nb):
    """Task 6.2: the bias folded as b s + beta, forgetting the running mean."""
    replace_in_cell(nb, "task-6-2-fold", "((b0 - mean) * s + beta)", "(b0 * s + beta)")


def stem_without_beta(nb):
    """Task 6.2 (b): a right fold_bn given the stem's batch norm without its shift beta: the weights are right, the
    bias is not. Only the stem's test fails, and its visible part says which node of the engine's pass differs."""
    replace_in_cell(nb, "task-6-2-stem", 'bn.weights["beta"]', '0 * bn.weights["beta"]')


def zero_scale(nb):
    """Task 6.3: a tensor of zeros gets scale 0."""
    replace_in_cell(nb, "task-6-3-int8", "return m / 127 if m > 0 else 1.0", "return m / 127")


def round_half_up(nb):
    """Task 6.3: halves rounded up (floor(v + 0.5)), not to even: codes differ at exact halves."""
    replace_in_cell(nb, "task-6-3-int8", "np.rint(x / np.float32(scale))", "np.floor(x / np.float32(scale) + 0.5)")


def no_clip(nb):
    """Task 6.3: no saturation: values past 127 scale wrap around in int8. The round trip's visible test stays
    in range; its hidden test checks the saturated values."""
    replace_in_cell(nb, "task-6-3-int8", "np.clip(np.rint(x / np.float32(scale)), -127, 127)",
                    "np.rint(x / np.float32(scale))")


def relu_before_residual(nb):
    """Task 6.4: the ReLU applied to conv + b and the residual added after it."""
    replace_in_cell(nb, "task-6-4-conv", """    y = y + b
    if residual is not None:
        y = y + residual
    return np.maximum(y, 0.0) if relu else y""", """    y = y + b
    if relu:
        y = np.maximum(y, 0.0)
    return y + residual if residual is not None else y""")


def symmetric_padding(nb):
    """Task 6.4: the top and left padding used for the bottom and right too (right only where they agree)."""
    replace_in_cell(nb, "task-6-4-conv", "xp = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))",
                    "xp = np.pad(x, ((0, 0), (top, top), (left, left), (0, 0)))")


# variant -> the tests it fails (all others pass)


def weights_per_image(nb):
    """Task 6.5 (a): the weights counted once per image, not once per batch: no batch makes a layer cross, and (b)
    follows its own crossover_batch, wrongly."""
    replace_in_cell(nb, "task-6-5-crossover", 'gain = cost["flops"] * bandwidth - cost["act_bytes"] * peak',
                    'gain = cost["flops"] * bandwidth - (cost["act_bytes"] + cost["weight_bytes"]) * peak')


def serve_past_the_crossing(nb):
    """Task 6.5 (b): a batch taken only when it is past every crossing (< for <=): one power of two too many."""
    replace_in_cell(nb, "task-6-5-decision", "all(b is None or b <= 2**i for b in crossings)",
                    "all(b is None or b < 2**i for b in crossings)")


class TestExercises(LessonExercises):
    LESSON = "06_inference_engine"
    NOTEBOOK = "inference_engine.ipynb"
    TIMEOUT = 60  # seconds per cell; the slowest, Task 6.1's hidden layers in the simulator, takes a few
    POINTS = {"test_6_1_results": 3, "test_6_1_fused": 1, "perf_6_1_speed": 2,
              "test_6_2_fold": 3, "test_6_2_stem": 1,
              "test_6_3_scale": 1, "test_6_3_quantize": 2, "test_6_3_roundtrip": 1, "perf_6_3_speed": 1,
              "test_6_4_results": 2, "test_6_4_residual": 2, "test_6_5_crossover": 2, "test_6_5_decision": 2}
    VARIANTS = {
        weights_per_image: ["test_6_5_crossover", "test_6_5_decision"],
        serve_past_the_crossing: ["test_6_5_decision"],
        no_relu: ["test_6_1_results"],
        relu_in_a_second_pass: ["test_6_1_fused"],
        no_padding_check: ["test_6_1_results"],  # one pass over y still: the fused test counts traffic only
        mean_not_subtracted: ["test_6_2_fold", "test_6_2_stem"],
        stem_without_beta: ["test_6_2_stem"],
        zero_scale: ["test_6_3_scale"],
        round_half_up: ["test_6_3_quantize"],
        no_clip: ["test_6_3_quantize", "test_6_3_roundtrip"],
        relu_before_residual: ["test_6_4_residual"],
        symmetric_padding: ["test_6_4_results"],
    }
    UNANSWERED = {"test_6_1_results": "NotImplementedError", "test_6_2_fold": "NotImplementedError",
                  "test_6_3_scale": "NotImplementedError", "test_6_4_results": "NotImplementedError",
                  "test_6_5_crossover": "NotImplementedError"}
    ANSWERS = ["np.rint(x / np.float32(scale))", "(b0 - mean) * s",
               "acc += x[n, hh, ww, c]", "stride * (ho - 1) + 1:stride",
               'cost["weight_bytes"] * peak / gain']

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "without the ReLU" in message("no_relu", "test_6_1_results")
        assert "reading y back" in message("relu_in_a_second_pass", "test_6_1_fused")
        assert "batchnorm(conv(x, w) + b)" in message("mean_not_subtracted", "test_6_2_fold")
        assert "node 'stem_bn/folded'" in message("stem_without_beta", "test_6_2_stem")
        assert "round half to even" in message("round_half_up", "test_6_3_quantize")  # a hidden test
        assert "goes in before the ReLU" in message("relu_before_residual", "test_6_4_residual")
