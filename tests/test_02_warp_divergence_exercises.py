"""Lesson 2's graded exercises through the real grader: the solution earns every point CPU mode can grade, the
released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU
mode (the notebooks' kernels are forced to the simulator), where the two performance tests are "not gradable
here"; their GPU side is checked by running the solution notebook on a GPU (python -m gpucourse run ...)."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, fill_in_exercise, replace_in_cell


pytestmark = [pytest.mark.lesson02, pytest.mark.slow]


def mixed_warps(nb):
    """Task 2.1 (a): a remapping that still covers each warp pair's 64 elements once, but in runs of 16 threads,
    so every warp holds both paths. The kernel, which follows it, is still right."""
    replace_in_cell(nb, "task-2-1-element-of", "return (t // 64) * 64 + 2 * (t % 32) + (t // 32) % 2",
             "return (t // 64) * 64 + 32 * ((t // 32) % 2) + 2 * (t % 16) + (t // 16) % 2")


def kernel_ignores_mapping(nb):
    """Task 2.1 (b): right results, but thread i still handles element i: element_of is right and unused."""
    replace_in_cell(nb, "task-2-1-kernel", "i = element_of(cuda.grid(1))", "i = cuda.grid(1)")


def wrong_offsets(nb):
    """Task 2.2: shuffle offsets that miss a step, in the model (16, 8, 4, 2, 2) and in the kernel (16 .. 2)."""
    replace_in_cell(nb, "task-2-2-model", "for offset in (16, 8, 4, 2, 1):", "for offset in (16, 8, 4, 2, 2):")
    replace_in_cell(nb, "task-2-2-kernel", "while offset > 0:", "while offset > 1:")


def atomic_per_thread(nb):
    """Task 2.2 (b): the lesson's atomics version, no shuffles: the sum is right, the kernel is not the task's."""
    kernel = next(c for c in nb.cells if c.get("id") == "task-2-2-kernel").source
    body = kernel[kernel.index("    offset = 16"): kernel.index("    ### END SOLUTION")]
    replace_in_cell(nb, "task-2-2-kernel", body, "    cuda.atomic.add(out, 0, acc)\n")


def early_return(nb):
    """Task 2.2 (b): threads past the end of x leave before the shuffles, which a full mask forbids: their lanes
    read undefined values (NaN in the simulator's stand-in). Every thread has elements in the visible kernel
    test, not in a hidden one nor in the launcher's."""
    replace_in_cell(nb, "task-2-2-kernel", "    acc = np.float32(0.0)\n",
             "    if cuda.grid(1) >= x.size:\n        return\n    acc = np.float32(0.0)\n")


def forgets_to_zero(nb):
    """Task 2.2 (c): out[0] is never set to zero, so the atomic adds go onto the NaN it starts with."""
    replace_in_cell(nb, "task-2-2-launcher", "    out[0] = 0\n", "")


def blocks_of_1024(nb):
    """Task 2.2 (c) with blocks of 1024 threads: right, and in CPU mode 1024 simulator threads a block."""
    replace_in_cell(nb, "task-2-2-launcher", "threads = 256", "threads = 1024")


def no_serialisation(nb):
    """Task 2.3 (a) and (c): costs as if a warp ran only its slowest lane's path (23 steps), and as if every
    warp held all five paths."""
    replace_in_cell(nb, "task-2-3-answers", "cost_a = 1 + 12 + 6 + 2 + 3 * 3 + 1", "cost_a = 1 + 12 + 3 * 3 + 1")
    replace_in_cell(nb, "task-2-3-slowdown", "slowdown_c = (2 + 4 * 6) / (2 + 6)", "slowdown_c = (2 + 5 * 6) / (2 + 6)")


def efficiency_of_whole_warps(nb):
    """Task 2.3 (a): the cost right, but every trip of the loop counted as if all 32 lanes took part."""
    replace_in_cell(nb, "task-2-3-answers", "(24 + 16 + 8) * 3", "32 * 3 * 3")


def slowdown_without_common_steps(nb):
    """Task 2.3 (c): the paths per warp right (4), but the 2 steps every thread runs left out of the ratio."""
    replace_in_cell(nb, "task-2-3-slowdown", "slowdown_c = (2 + 4 * 6) / (2 + 6)", "slowdown_c = 4 * 6 / 6")


def average_cost_in_exercise(nb):
    """The released exercise filled in, with expected_warp_cost = expected paths x the mean body: right when the
    two bodies cost the same, which is all the visible test tries; the hidden tests nbgrader puts back try
    bodies of different costs."""
    fill_in_exercise(nb, TestExercises.solution(), TestExercises.exercise())
    replace_in_cell(nb, "task-2-3-expected", "return rare * (1 - (1 - fraction) ** WARP) + common * (1 - fraction ** WARP)",
             "return wd.expected_paths(fraction) * (rare + common) / 2")
    assert "HIDDEN" not in "".join(c.source for c in nb.cells)


# variant -> the tests it fails (all others pass)



def regroup_without_build(nb):
    """Task 2.4 (a): the permutation's cost left out, so regrouping "pays" as soon as any warp may diverge: at a
    fraction of 1e-6 the visible test catches it."""
    replace_in_cell(nb, "task-2-4-regroup", "(1 - fraction) * common + build", "(1 - fraction) * common")


def regroup_whenever_divergent(nb):
    """Task 2.4: a decision by rule of thumb, not the model: regroup as soon as some warp may diverge, and the
    smallest fraction offered as the answer. The visible (a) case at 1e-6 catches the rule; (b) is wrong."""
    replace_in_cell(nb, "task-2-4-regroup", "return bool(regrouped < random_order)", "return fraction > 0")
    replace_in_cell(nb, "task-2-4-decision", "SMALLEST_FRACTION = 1 / 64", "SMALLEST_FRACTION = 1 / 4096")

class TestExercises(LessonExercises):
    LESSON = "02_warp_divergence"
    NOTEBOOK = "warp_divergence.ipynb"
    TIMEOUT = 60  # seconds per cell: the slowest, Task 2.2's kernel in the simulator, takes a few
    POINTS = {"test_2_1_element_of": 2, "test_2_1_kernel": 2, "test_2_1_warps": 1, "perf_2_1_regrouped": 2,
              "test_2_2_model": 2, "test_2_2_kernel": 2, "test_2_2_launcher": 1, "perf_2_2_shuffle_sum": 2,
              "test_2_3_cost": 1, "test_2_3_efficiency": 1, "test_2_3_expected_cost": 2, "test_2_3_slowdown": 1,
              "test_2_4_regroup": 2, "test_2_4_decision": 1}
    VARIANTS = {
        mixed_warps: ["test_2_1_element_of"],
        kernel_ignores_mapping: ["test_2_1_warps"],
        wrong_offsets: ["test_2_2_model", "test_2_2_kernel", "test_2_2_launcher"],
        atomic_per_thread: ["test_2_2_kernel"],
        early_return: ["test_2_2_kernel", "test_2_2_launcher"],
        forgets_to_zero: ["test_2_2_launcher"],
        blocks_of_1024: [],
        no_serialisation: ["test_2_3_cost", "test_2_3_efficiency", "test_2_3_slowdown"],
        efficiency_of_whole_warps: ["test_2_3_efficiency"],
        slowdown_without_common_steps: ["test_2_3_slowdown"],
        average_cost_in_exercise: ["test_2_3_expected_cost", "test_2_4_regroup"],  # Task 2.4 builds on 2.3 (b)
        regroup_without_build: ["test_2_4_regroup"],
        regroup_whenever_divergent: ["test_2_4_regroup", "test_2_4_decision"],
    }
    UNANSWERED = {"test_2_1_element_of": "NotImplementedError", "test_2_1_kernel": "NotImplementedError",
                  "test_2_2_model": "NotImplementedError", "test_2_2_kernel": "NotImplementedError",
                  "test_2_3_expected_cost": "NotImplementedError", "test_2_3_cost": "NameError",
                  "test_2_4_regroup": "NotImplementedError", "test_2_4_decision": "NameError"}
    ANSWERS = ["(t // 64) * 64", "shfl_down_sync(FULL_MASK, acc"]

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "threads 0..31 holds 2 paths" in message("mixed_warps", "test_2_1_element_of")
        assert "element_of gives its threads" in message("kernel_ignores_mapping", "test_2_1_warps")
        assert "want 499500" in message("wrong_offsets", "test_2_2_model")
        assert "the exact sum is" in message("wrong_offsets", "test_2_2_kernel")
        assert "ran [0] shuffles" in message("atomic_per_thread", "test_2_2_kernel")
        assert "33 elements: got nan" in message("early_return", "test_2_2_kernel")  # a hidden test
        assert "got nan" in message("forgets_to_zero", "test_2_2_launcher")
        assert "cost_a = 23 is not the model's cost" in message("no_serialisation", "test_2_3_cost")
        assert "slowdown_c = 4.0 is not the model's" in message("no_serialisation", "test_2_3_slowdown")
        assert "efficiency_a = 0.532" in message("efficiency_of_whole_warps", "test_2_3_efficiency")
        assert "slowdown_c = 4.0 is not the model's" in message("slowdown_without_common_steps", "test_2_3_slowdown")
        assert "expected_warp_cost(0.015625, 10, 1)" in message("average_cost_in_exercise", "test_2_3_expected_cost")
        assert "regroup_pays(1e-6, 10, 10, 1): hardly a warp diverges" in message("regroup_without_build",
                                                                                  "test_2_4_regroup")
        assert "is not the model's" in message("regroup_whenever_divergent", "test_2_4_decision")
