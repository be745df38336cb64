"""Lesson 3's graded exercises (memory) through the real grader: the solution earns every point CPU mode can grade,
the released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU
mode (the notebooks' kernels are forced to the simulator), where the three performance tests are "not gradable
here"; their GPU side is checked by running the solution notebook on a GPU (python -m gpucourse run ...)."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson03, pytest.mark.slow]


def rotate_without_barrier(nb):
    """Task 3.1: the tile read before every warp has written its part (no cuda.syncthreads()): a race, which the
    simulator's thread order exposes as wrong elements."""
    replace_in_cell(nb, "task-3-1-kernel", "    cuda.syncthreads()\n", "")


def rotate_is_a_transpose(nb):
    """Task 3.1: the tile written out as a transpose, not a rotation (the column index not mirrored)."""
    replace_in_cell(nb, "task-3-1-kernel", "out[c0 + ty + j, rows - 1 - r] = tile[TILE - 1 - tx, ty + j]",
                    "out[c0 + ty + j, r] = tile[TILE - 1 - tx, ty + j]")


def matmul_wrong_tile_index(nb):
    """Task 3.2: b's tile loaded with the thread indices swapped, and read as if it were not."""
    replace_in_cell(nb, "task-3-2-kernel", "sb[half * MM_TILE + ty, tx] = b[jb, k] if jb < n and k < k_total",
                    "sb[half * MM_TILE + tx, ty] = b[jb, k] if jb < n and k < k_total")


def matmul_without_second_barrier(nb):
    """Task 3.2: no barrier before the next step's loads: fast threads overwrite tiles slow ones still read."""
    replace_in_cell(nb, "task-3-2-kernel", "            acc1 += x * sb[MM_TILE + tx, kk]\n        cuda.syncthreads()\n",
                    "            acc1 += x * sb[MM_TILE + tx, kk]\n")


def aos_one_sector_a_lane(nb):
    """Task 3.3 (a): every lane counted as its own sector, as if the stride were 8 or more."""
    replace_in_cell(nb, "task-3-3-layouts", "aos_sectors = 16", "aos_sectors = 32")


def widths_not_multiple_of_32(nb):
    """Task 3.3 (b): any width that is not a multiple of 32 taken as conflict-free (16, 34, 48 are not)."""
    replace_in_cell(nb, "task-3-3-widths",
                    "return [w for w in widths if all(mm.bank_conflict_ways(lanes * w + c) == 1 for c in range(32))]",
                    "return [w for w in widths if w % 32 != 0]")


def blur_wraps_around(nb):
    """Task 3.4: the halo wraps around to the other side of the image instead of being clamped."""
    replace_in_cell(nb, "task-3-4-kernel", "img[min(max(r0 + tr, 0), rows - 1), min(max(c0 + tc, 0), cols - 1)]",
                    "img[(r0 + tr) % rows, (c0 + tc) % cols]")


def blur_without_weights(nb):
    """Task 3.4: the row pass a plain mean of three (1 1 1 over 3), not 1 2 1: the weights not separated right."""
    replace_in_cell(nb, "task-3-4-kernel",
                    "rowpass[tr, tx] = tile[tr, tx] + np.float32(2.0) * tile[tr, tx + 1] + tile[tr, tx + 2]",
                    "rowpass[tr, tx] = np.float32(4.0 / 3.0) * (tile[tr, tx] + tile[tr, tx + 1] + tile[tr, tx + 2])")


class TestExercises(LessonExercises):
    LESSON = "03_memory"
    NOTEBOOK = "memory.ipynb"
    TIMEOUT = 90  # seconds per cell: the hidden rotate and matmul tests run a few thousand simulator threads
    POINTS = {"test_3_1_rotate": 3, "perf_3_1_rotate": 2, "test_3_2_matmul": 3, "perf_3_2_matmul": 2,
              "test_3_3_layouts": 2, "test_3_3_widths": 2, "test_3_4_blur": 3, "perf_3_4_blur": 2}
    VARIANTS = {
        rotate_without_barrier: ["test_3_1_rotate"],
        rotate_is_a_transpose: ["test_3_1_rotate"],
        matmul_wrong_tile_index: ["test_3_2_matmul"],
        matmul_without_second_barrier: ["test_3_2_matmul"],
        aos_one_sector_a_lane: ["test_3_3_layouts"],
        widths_not_multiple_of_32: ["test_3_3_widths"],
        blur_wraps_around: ["test_3_4_blur"],
        blur_without_weights: ["test_3_4_blur"],
    }
    UNANSWERED = {"test_3_1_rotate": "must go through", "test_3_2_matmul": "must go through",
                  "test_3_3_layouts": "NameError", "test_3_3_widths": "NotImplementedError",
                  "test_3_4_blur": "must go through"}
    ANSWERS = ["rows - 1 - r] = tile[TILE - 1 - tx, j]", "sb[tx, kk]", "rowpass[ty + 2, tx]",
               "aos_sectors = 16"]

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "elements wrong" in message("rotate_is_a_transpose", "test_3_1_rotate")
        assert "how many bytes do the 32 lanes span" in message("aos_one_sector_a_lane", "test_3_3_layouts")
        assert "elements wrong" in message("blur_wraps_around", "test_3_4_blur")
