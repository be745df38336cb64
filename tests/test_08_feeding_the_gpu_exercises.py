"""Lesson 8's graded exercises through the real grader: the solution earns every point CPU mode can grade, the
released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU mode
(Task 8.1's kernel in the simulator, its streams' work interleaved by systems/feeding_the_gpu/stream_sim.py), where the speed test (perf_8_1_speed)
is "not gradable here"; its GPU side is checked by running the solution notebook on a GPU
(python -m gpucourse run ... --mode gpu). Tasks 8.3 and 8.4 read the lesson's GPU record in results/."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson08, pytest.mark.slow]


def last_chunk_skipped(nb):
    """Task 8.1: the loop stops one chunk early: the last chunk's products are never computed."""
    replace_in_cell(nb, "task-8-1-pipeline", "for i in range(chunks):", "for i in range(chunks - 1):")


def no_split_check(nb):
    """Task 8.1: the chunk size rounded down without checking that the chunks divide n: a remainder is lost
    silently, and a bad split is not refused."""
    replace_in_cell(nb, "task-8-1-pipeline", "size = feed.check_pipeline(a.size, chunks, streams)",
                    "size = a.size // chunks")


def wrong_slot(nb):
    """Task 8.1: every chunk's result copied from stream 0's buffer: right with one stream only."""
    replace_in_cell(nb, "task-8-1-pipeline", "da.copy_to_host(out[part], stream=s)",
                    "lanes[0][1].copy_to_host(out[part], stream=s)")


def product_over_b(nb):
    """Task 8.1: the product written over b's copy while the result is copied back from a's: out = a."""
    replace_in_cell(nb, "task-8-1-pipeline", "feed.multiply_kernel[blocks, THREADS, s](da, db, da)",
                    "feed.multiply_kernel[blocks, THREADS, s](da, db, db)")


def shared_buffers(nb):
    """Task 8.1: one set of device buffers for every stream: right when the streams run one after another (as
    the simulator alone runs them), wrong when they run together."""
    replace_in_cell(nb, "task-8-1-pipeline", "s, da, db = lanes[i % streams]",
                    "s, (_, da, db) = lanes[i % streams][0], lanes[0]")


def first_stream_synchronised(nb):
    """Task 8.1: only the first stream waited for: the others may still be copying results back."""
    replace_in_cell(nb, "task-8-1-pipeline", "for lane in lanes:\n        lane[0].synchronize()",
                    "lanes[0][0].synchronize()")


def full_batches_only(nb):
    """Task 8.2: the maximum wait ignored: a batch starts only when max_batch requests wait (or none will come)."""
    replace_in_cell(nb, "task-8-2-batcher", "start = max(free, min(t[i] + max_wait, full))",
                    "start = max(free, full if full < np.inf else t[-1])")


def server_never_busy(nb):
    """Task 8.2: a batch starts without waiting for the server to be free: batches overlap in time."""
    replace_in_cell(nb, "task-8-2-batcher", "start = max(free, min(t[i] + max_wait, full))",
                    "start = min(t[i] + max_wait, full)")


def inverted_gain(nb):
    """Task 8.3: time-slicing over MPS instead of MPS over time-slicing."""
    replace_in_cell(nb, "task-8-3-answer",
                    'mps_gain = MPS["configs"]["MPS, batch 1"][largest]["images_per_s"] / sliced[largest]["images_per_s"]',
                    'mps_gain = sliced[largest]["images_per_s"] / MPS["configs"]["MPS, batch 1"][largest]["images_per_s"]')


def more_processes_more_images(nb):
    """Task 8.3: time-slicing predicted to serve more with more processes, as MPS does."""
    replace_in_cell(nb, "task-8-3-predict", "predicted_best_k = 1 ", "predicted_best_k = 16 ")


def gain_at_smallest_k(nb):
    """Task 8.3: the gains read at the smallest k of the table (one client), not the largest."""
    replace_in_cell(nb, "task-8-3-answer",
                    'largest = str(max(int(c) for c in MPS["configs"]["time-slicing, batch 1"]))',
                    'largest = str(min(int(c) for c in MPS["configs"]["time-slicing, batch 1"]))')


def closed_intervals(nb):
    """Task 8.4: every moment some stage runs counted, not only those where two do: the busy fraction."""
    replace_in_cell(nb, "task-8-4-overlap", "if running >= 2:", "if running >= 1:")


def overlap_by_reference(nb):
    """Task 8.4: the lesson's own S.overlap_fraction, reached through another module with getattr: refused."""
    replace_in_cell(nb, "task-8-4-overlap", "    events = sorted(",
                    "    return getattr(feeding.S, \"overlap_fraction\")(timeline)\n    events = sorted(")


class TestExercises(LessonExercises):
    LESSON = "08_feeding_the_gpu"
    NOTEBOOK = "feeding_the_gpu.ipynb"
    TIMEOUT = 60
    POINTS = {"test_8_1_results": 3, "test_8_1_errors": 1, "perf_8_1_speed": 2, "test_8_2_batcher": 3,
              "test_8_3_predict": 1, "test_8_3_table": 2, "test_8_4_overlap": 2}
    VARIANTS = {
        last_chunk_skipped: ["test_8_1_results"],
        no_split_check: ["test_8_1_errors"],
        wrong_slot: ["test_8_1_results"],
        product_over_b: ["test_8_1_results"],
        shared_buffers: ["test_8_1_results"],
        first_stream_synchronised: ["test_8_1_results"],
        full_batches_only: ["test_8_2_batcher"],
        server_never_busy: ["test_8_2_batcher"],
        more_processes_more_images: ["test_8_3_predict"],
        inverted_gain: ["test_8_3_table"],
        gain_at_smallest_k: ["test_8_3_table"],
        closed_intervals: ["test_8_4_overlap"],
        overlap_by_reference: ["test_8_4_overlap"],
    }
    UNANSWERED = {"test_8_1_results": "NotImplementedError", "test_8_2_batcher": "NotImplementedError",
                  "test_8_4_overlap": "NotImplementedError"}
    ANSWERS = ["feed.multiply_kernel[blocks, THREADS, s](da, db, da)", "start = max(free, min(t[i] + max_wait, full))",
               "if running >= 2:"]

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "wrong elements" in message("last_chunk_skipped", "test_8_1_results")
        assert "wrong elements" in message("shared_buffers", "test_8_1_results")
        assert "still queued on its streams" in message("first_stream_synchronised", "test_8_1_results")
        assert any("lesson's own answer to Task 8.4" in n and "task_8_4_overlap" in n
                   for n in graded["overlap_by_reference"].notes), graded["overlap_by_reference"].format()
        assert "batch sizes" in message("full_batches_only", "test_8_2_batcher")
        assert "one context at a time" in message("more_processes_more_images", "test_8_3_predict")  # a hidden test
        assert "mps_gain" in message("inverted_gain", "test_8_3_table")
        assert "at the largest k of the table" in message("gain_at_smallest_k", "test_8_3_table")  # a visible test
