"""Lesson 7's graded exercises through the real grader: the solution earns every point, the released exercise none,
and known-wrong answers exactly the points their mistakes leave them. Everything runs in CPU mode: Tasks 7.2 to 7.4
are graded on the simulated ring's virtual clock (kernels/collectives/ring_sim.py), whose times do not depend on how the
threads are scheduled, and Task 7.5's schedule (the broadcast both ways round the ring, every copy on its
receiver's stream) on the CPU model of streams and events (col.SimRing), which, like CUDA, lets a wait on an event
not yet recorded pass at once, so that a schedule queued in the wrong order copies stale memory; its two GPU tests
(test_7_5_results, perf_7_5_speed) need two or more GPUs and are "not gradable here"; their GPU side is checked by
running the solution notebook on a machine with two GPUs (python -m gpucourse run ... --mode gpu)."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson07, pytest.mark.slow]


def no_latency_steps(nb):
    """Task 7.1 (a): the latency paid once per message, not once per step: S alpha instead of (S + k - 2) alpha."""
    replace_in_cell(nb, "task-7-1-time", "return (S + k - 2) * (alpha + N / (S * B))",
                    "return S * alpha + (S + k - 2) * N / (S * B)")


def rounded_optimum(nb):
    """Task 7.1 (b): S* rounded to the nearest whole number, without comparing the two neighbours."""
    replace_in_cell(nb, "task-7-1-best",
                    "    return min(sorted(candidates), key=lambda c: (c + k - 2) * (alpha + N / (c * B)))\n",
                    "    return max(1, round(s))\n")


def never_pipeline(nb):
    """Task 7.1 (b): one message whatever k, as if there were nothing to pipeline: far slower than the measured best
    on four GPUs at 64 MiB and above."""
    replace_in_cell(nb, "task-7-1-best", "if k == 2:", "if k >= 2:")


def root_is_zero(nb):
    """Task 7.2: the chain counted as if the root were rank 0 whatever the root: right only when it is."""
    replace_in_cell(nb, "task-7-2-rank", "after_root = (comm.rank - root - 1) % k", "after_root = (comm.rank - 1) % k")


def store_and_forward(nb):
    """Task 7.2: every chunk received before any is passed on: the right sum, no pipelining."""
    replace_in_cell(nb, "task-7-2-rank", """    for i in range(S):
        part = slice(*chunk_bounds(x.size, S, i))
        if after_root > 0:
            x[part] += comm.recv()  # chunk i summed over the ranks before this one
        if after_root < k - 1:
            comm.send(x[part])
""", """    if after_root > 0:
        for i in range(S):
            part = slice(*chunk_bounds(x.size, S, i))
            x[part] += comm.recv()
    if after_root < k - 1:
        for i in range(S):
            part = slice(*chunk_bounds(x.size, S, i))
            comm.send(x[part])
""")


def whole_buffer(nb):
    """Task 7.2: one message of the whole array, S ignored: the right sum, (k - 1) N / B."""
    replace_in_cell(nb, "task-7-2-rank", "part = slice(*chunk_bounds(x.size, S, i))", "part = slice(*chunk_bounds(x.size, 1, 0))")
    replace_in_cell(nb, "task-7-2-rank", "for i in range(S):", "for i in range(1):")


def forward_without_adding(nb):
    """Task 7.2: each rank passes on what it received without adding its own values: the root ends with the first
    rank's array plus its own."""
    replace_in_cell(nb, "task-7-2-rank", "x[part] += comm.recv()", "x[part] = comm.recv()")


def store_not_add(nb):
    """Task 7.3: the reduce-scatter stores the received chunk instead of adding it: the right messages, the wrong
    sums."""
    replace_in_cell(nb, "task-7-3-rank", "x[slice(*chunk_bounds(x.size, k, (r - 1 - s) % k))] += comm.recv()",
                    "x[slice(*chunk_bounds(x.size, k, (r - 1 - s) % k))] = comm.recv()")


def pass_whole_arrays(nb):
    """Task 7.3: whole arrays passed round the ring and added up: the right sum, k times the ring's traffic per
    message and k - 1 messages instead of 2 (k - 1)."""
    replace_in_cell(nb, "task-7-3-rank", """    for s in range(k - 1):
        comm.send(x[slice(*chunk_bounds(x.size, k, (r - s) % k))])
        x[slice(*chunk_bounds(x.size, k, (r - 1 - s) % k))] += comm.recv()
    for s in range(k - 1):
        comm.send(x[slice(*chunk_bounds(x.size, k, (r + 1 - s) % k))])
        x[slice(*chunk_bounds(x.size, k, (r - s) % k))] = comm.recv()
""", """    passing = x.copy()
    for s in range(k - 1):
        comm.send(passing)
        passing = comm.recv()
        x += passing
""")


def sum_not_mean(nb):
    """Task 7.4: the all-reduce's sum, not divided by k."""
    replace_in_cell(nb, "task-7-4-average", "col.unflatten(v / k, grads[0])", "col.unflatten(v, grads[0])")


def pull_on_sender(nb):
    """Task 7.5: the copies queued on the sender's stream while the receiver's event is recorded on it: CUDA (and
    the model) refuse an event recorded on another GPU's stream."""
    replace_in_cell(nb, "task-7-5-pull", "stream = ring.streams[r]", "stream = ring.streams[src]")


def pull_without_waiting(nb):
    """Task 7.5: no wait for chunk i to reach the sender before the receiver pulls it: stale memory is copied on."""
    replace_in_cell(nb, "task-7-5-pull", """            if src != 0:
                stream.wait_event(ring.event(src, i))  # chunk i has reached the sender
""", "")


def queued_gpu_by_gpu(nb):
    """Task 7.5: the right copies, waits and events, queued GPU by GPU (1, 2, ..., k - 1) instead of nearest GPU 0
    first: from k = 5 on, GPU k - 2's stream waits on GPU k - 1's event before it has been recorded, the wait passes
    at once (as in CUDA) and GPU k - 2 copies stale memory."""
    replace_in_cell(nb, "task-7-5-pull", "for r in sorted(range(1, k), key=lambda r: min(r, k - r)):",
                    "for r in range(1, k):")


class TestExercises(LessonExercises):
    LESSON = "07_collectives"
    NOTEBOOK = "collectives.ipynb"
    TIMEOUT = 60  # seconds per cell; the slowest takes well under one
    POINTS = {"test_7_1_time": 2, "test_7_1_best": 1, "test_7_1_measured": 1, "test_7_2_data": 2, "test_7_2_pipelined": 2,
              "test_7_3_results": 2, "test_7_3_traffic": 1, "test_7_4_gradients": 2,
              "test_7_5_schedule": 2, "test_7_5_results": 2, "perf_7_5_speed": 2}
    MULTI_GPU = {"test_7_5_results": 2}  # results on GPUs: graded on a machine with two or more
    VARIANTS = {
        no_latency_steps: ["test_7_1_time"],
        rounded_optimum: ["test_7_1_best"],
        never_pipeline: ["test_7_1_best", "test_7_1_measured"],
        root_is_zero: ["test_7_2_data", "test_7_2_pipelined"],
        store_and_forward: ["test_7_2_pipelined"],
        whole_buffer: ["test_7_2_pipelined"],
        forward_without_adding: ["test_7_2_data", "test_7_2_pipelined"],
        store_not_add: ["test_7_3_results", "test_7_4_gradients"],
        pass_whole_arrays: ["test_7_3_traffic"],
        sum_not_mean: ["test_7_4_gradients"],
        pull_on_sender: ["test_7_5_schedule"],
        pull_without_waiting: ["test_7_5_schedule"],
        queued_gpu_by_gpu: ["test_7_5_schedule"],
    }
    UNANSWERED = {"test_7_1_time": "NotImplementedError", "test_7_1_best": "NotImplementedError",
                  "test_7_1_measured": "NotImplementedError",
                  "test_7_2_data": "NotImplementedError", "test_7_2_pipelined": "NotImplementedError",
                  "test_7_3_results": "NotImplementedError", "test_7_3_traffic": "NotImplementedError",
                  "test_7_4_gradients": "NotImplementedError", "test_7_5_schedule": "NotImplementedError"}
    ANSWERS = ["(S + k - 2) * (alpha + N / (S * B))",
               "after_root = (comm.rank - root - 1) % k",
               "col.unflatten(v / k, grads[0])",
               "key=lambda r: min(r, k - r)"]

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "want" in message("no_latency_steps", "test_7_1_time")
        assert "takes" in message("rounded_optimum", "test_7_1_best")  # a hidden test
        assert "within 10% of the fastest measured" in message("never_pipeline", "test_7_1_measured")
        assert "differs from the sum" in message("root_is_zero", "test_7_2_data")
        assert "as soon as it has arrived" in message("store_and_forward", "test_7_2_pipelined")
        assert "one per chunk" in message("whole_buffer", "test_7_2_pipelined")
        assert "differs from the sum" in message("store_not_add", "test_7_3_results")
        assert "2 (k - 1)" in message("pass_whole_arrays", "test_7_3_traffic")
        assert "whole batch" in message("sum_not_mean", "test_7_4_gradients")
        assert "cannot be recorded" in message("pull_on_sender", "test_7_5_schedule")
        assert "stale" in message("pull_without_waiting", "test_7_5_schedule")
        assert "GPU 3 ends with" in message("queued_gpu_by_gpu", "test_7_5_schedule")  # the visible test, k = 5
        assert "not yet recorded" in message("queued_gpu_by_gpu", "test_7_5_schedule")
