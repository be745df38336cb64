"""Lesson 9's graded exercises through the real grader: the solution earns every point, the released exercise none,
and known-wrong answers exactly the points their mistakes leave them. Everything runs in CPU mode on NumPy; Task
8.2's speed (perf_9_2_speed) is timed on a GPU only and is "not gradable here"."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson09, pytest.mark.slow]


def no_reset(nb):
    """Task 9.1: a back-off keeps the count of good steps: the scale grows back too soon."""
    replace_in_cell(nb, "task-9-1-rule", "return max(scale * backoff, min_scale), 0, left",
                    "return max(scale * backoff, min_scale), good_steps, left")


def no_floor(nb):
    """Task 9.1: the scale backed off below min_scale."""
    replace_in_cell(nb, "task-9-1-rule", "max(scale * backoff, min_scale)", "scale * backoff")


def store_everything(nb):
    """Task 9.2: every layer's input kept: right gradients, no memory saved."""
    replace_in_cell(nb, "task-9-2-ckpt", "        if i in keep:\n            saved[i] = z\n", "        saved[i] = z\n")
    replace_in_cell(nb, "task-9-2-ckpt", """        while len(inputs) < stop - start:  # the segment's other inputs, from its checkpoint
            i = start + len(inputs) - 1
            inputs.append(layer_forward(*params[i], inputs[-1], i == 0))
""", """        for i in range(start + 1, stop):
            inputs.append(saved.pop(i))
""")


def no_schedule_check(nb):
    """Task 9.2: a schedule that breaks the rule (no 0, not increasing, beyond the depth) is not refused."""
    replace_in_cell(nb, "task-9-2-ckpt", """    if not bounds or bounds[0] != 0 or any(b >= c for b, c in zip(bounds, bounds[1:])) or bounds[-1] >= n:
        raise ValueError(f"checkpoints must be increasing layer numbers from 0, below {n}: got {checkpoints!r}")
""", "")


def sum_not_mean(nb):
    """Task 9.3: the towers' gradients summed, not averaged."""
    replace_in_cell(nb, "task-9-3-towers", "sum(t[1][i][j] for t in towers) / k", "sum(t[1][i][j] for t in towers)")


def uneven_allowed(nb):
    """Task 9.3: a batch that does not split evenly is not refused (the last rows are dropped)."""
    replace_in_cell(nb, "task-9-3-towers", """    if X.shape[0] % k:
        raise ValueError(f"a batch of {X.shape[0]} does not split into {k} equal shards")
""", "")


def no_unscale(nb):
    """Task 9.4: the scaled gradients applied as they are: steps loss-scale times too large."""
    replace_in_cell(nb, "task-9-4-mixed", "scale=1.0 / scaler.scale", "scale=1.0")


def apply_on_overflow(nb):
    """Task 9.4: the step applied even when the gradients overflowed: inf and NaN in the master weights."""
    replace_in_cell(nb, "task-9-4-mixed", "    if finite:\n", "    if True:\n")


def still_eager(nb):
    """Task 9.5: the step left eager (no tf.function): right results, but no graph to reuse."""
    replace_in_cell(nb, "task-9-5-graph", "    @tf.function\n", "")


def rebinds(nb):
    """Task 9.5: new tensors bound to the list's slots instead of assign_sub: the graph's variables never move."""
    replace_in_cell(nb, "task-9-5-graph", """        for v, g in zip(vs, tape.gradient(loss, vs)):
            v.assign_sub(lr * g)
""", """        for i, g in enumerate(tape.gradient(loss, vs)):
            vs[i] = vs[i] - lr * g
""")


def checkpoint_by_keyword(nb):
    """Task 9.2: the lesson's tr.loss_and_grads asked to checkpoint (checkpoint_every=...): refused."""
    replace_in_cell(nb, "task-9-2-ckpt", "    n = len(params)\n",
                    "    return tr.loss_and_grads(params, X, y, checkpoint_every=len(checkpoints))\n    n = len(params)\n")


def even_spacing(nb):
    """Task 9.6: the best even spacing (s = 2), predicted right: the prediction's point, not the decision's."""
    replace_in_cell(nb, "task-9-6-answers", "MY_CHECKPOINTS = [0, 4, 6, 9]\npredicted_mib = 72.0",
                    "MY_CHECKPOINTS = [0, 2, 4, 6, 8, 10]\npredicted_mib = 80.0")


def count_not_bytes(nb):
    """Task 9.6: the right schedule, its peak predicted as 9 inputs of 1024 (36 MiB) at a batch of 1024."""
    replace_in_cell(nb, "task-9-6-answers", "predicted_mib = 72.0", "predicted_mib = 36.0")


class TestExercises(LessonExercises):
    LESSON = "09_training"
    NOTEBOOK = "training.ipynb"
    TIMEOUT = 60
    POINTS = {"test_9_1_rule": 2, "test_9_2_grads": 2, "test_9_2_memory": 2, "perf_9_2_speed": 2,
              "test_9_3_average": 2, "test_9_3_uneven": 1, "test_9_4_step": 2, "test_9_4_overflow": 1,
              "test_9_5_same": 2, "test_9_5_once": 1, "test_9_6_prediction": 1, "test_9_6_decision": 2}
    VARIANTS = {
        no_reset: ["test_9_1_rule"],
        no_floor: ["test_9_1_rule"],
        store_everything: ["test_9_2_memory"],
        no_schedule_check: ["test_9_2_grads"],
        sum_not_mean: ["test_9_3_average"],
        uneven_allowed: ["test_9_3_uneven"],
        no_unscale: ["test_9_4_step", "test_9_4_overflow"],
        apply_on_overflow: ["test_9_4_overflow"],
        still_eager: ["test_9_5_same", "test_9_5_once"],
        rebinds: ["test_9_5_same", "test_9_5_once"],
        checkpoint_by_keyword: ["test_9_2_grads", "test_9_2_memory"],
        even_spacing: ["test_9_6_decision"],
        count_not_bytes: ["test_9_6_prediction"],
    }
    UNANSWERED = {g: "NameError" if g.startswith("test_9_6") else "NotImplementedError"
                  for g in POINTS if not g.startswith("perf_")}
    ANSWERS = ["max(scale * backoff, min_scale)", "saved[i] = z", "MY_CHECKPOINTS = [0, 4, 6, 9]", "X.shape[0] % k", "scale=1.0 / scaler.scale",
               "    @tf.function\n    def step(X, y):"]

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "want" in message("no_reset", "test_9_1_rule")
        assert "held at once" in message("store_everything", "test_9_2_memory")
        assert "must raise ValueError" in message("no_schedule_check", "test_9_2_grads")
        assert "the best even spacing" in message("even_spacing", "test_9_6_decision")  # a hidden test
        assert "the model gives 72.0 MiB" in message("count_not_bytes", "test_9_6_prediction")
        assert "one device on the whole batch" in message("sum_not_mean", "test_9_3_average")
        assert "does not split evenly" in message("uneven_allowed", "test_9_3_uneven")
        assert "master weights differ" in message("no_unscale", "test_9_4_step")
        assert "master weights differ" in message("apply_on_overflow", "test_9_4_overflow")
        assert "not a tf.function" in message("still_eager", "test_9_5_same")
        assert "not a tf.function" in message("still_eager", "test_9_5_once")
        assert any("checkpoint_every=" in n and "lesson's own answer to Task 9.2" in n
                   for n in graded["checkpoint_by_keyword"].notes), graded["checkpoint_by_keyword"].format()
