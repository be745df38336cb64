"""Lesson 4's graded exercises through the real grader: the solution earns every point CPU mode can grade, the
released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU
mode (Task 4.1's kernel in the simulator, Task 4.2's compiled to PTX with NVRTC and its address arithmetic run
by the NumPy emulation of WMMA), where the three GPU-only tests
(perf_*) are "not gradable here"; their GPU side is checked by running the solution notebook on a GPU
(python -m gpucourse run ... --mode gpu)."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson04, pytest.mark.slow]


def no_second_barrier(nb):
    """Task 4.1: no barrier after the products, so a fast thread overwrites the tiles while others still read
    them. The simulator runs a block's threads at once, and the race shows in every multi-tile product."""
    replace_in_cell(nb, "task-4-1-kernel",
             "        cuda.syncthreads()  # every thread is done with them before the next iteration overwrites them\n", "")


def products_from_global(nb):
    """Task 4.1: the tiles are loaded and synchronised, but the products read X and W from global memory: right
    results, 2K global reads per thread."""
    replace_in_cell(nb, "task-4-1-kernel", "acc += sx[ty, k] * swt[k, tx]",
             "acc += X[row, k0 + k] * W[col, k0 + k] if row < M and col < N and k0 + k < K else np.float32(0.0)")


def uncoalesced_w(nb):
    """Task 4.1: W's tile read the way B's is in the lesson, thread (tx, ty) taking W[bx TILE + tx, k0 + ty]:
    right results and one read per tile, but consecutive threads of a warp read elements K apart."""
    replace_in_cell(nb, "task-4-1-kernel",
                    "        w_row = cuda.blockIdx.x * TILE + ty  # a row of W per ty, consecutive tx along it: coalesced\n"
                    "        swt[tx, ty] = W[w_row, k0 + tx] if w_row < N and k0 + tx < K else np.float32(0.0)\n",
                    "        swt[ty, tx] = W[col, k0 + ty] if col < N and k0 + ty < K else np.float32(0.0)\n")


def wrong_b_pointer(nb):
    """Task 4.2: X's tile offset without the factor 16 on tj: it compiles with the right layouts, and the
    emulation, which runs the same arithmetic, reads the wrong columns of X (CPU mode)."""
    replace_in_cell(nb, "task-4-2-loop", "(k * K + tj * 16, K)", "(k * K + tj, K)")


def b_read_as_transposed(nb):
    """Task 4.2: X's tile addressed as if X were stored K x M (X^T's rows): the emulation reads the wrong elements
    of X (in the visible test's shape, all of them inside X)."""
    replace_in_cell(nb, "task-4-2-loop", "(k * K + tj * 16, K)", "(tj * 16 * M + k, M)")


def row_major_a(nb):
    """Task 4.2: dY^T's fragment declared row-major, which reads dY's tile untransposed: it compiles; the hidden
    layout checks and the emulated results fail."""
    replace_in_cell(nb, "task-4-2-loop", 'LAYOUTS = ("col_major", "row_major")', 'LAYOUTS = ("row_major", "row_major")')


def endpoint_slope(nb):
    """Task 4.3 (b): the slope through the first and last points only: exact on a clean power law, not the
    least-squares fit on noisy data. The measured exponents stay within 0.1 of the model's."""
    replace_in_cell(nb, "task-4-3-exponent",
             "    slope, _ = np.polyfit(np.log(np.asarray(ks, float)), np.log(np.asarray(errors, float)), 1)\n",
             "    slope = math.log(errors[-1] / errors[0]) / math.log(ks[-1] / ks[0])\n")


def linear_explanation(nb):
    """Task 4.3 (c): the wrong statement."""
    replace_in_cell(nb, "task-4-3-answers", 'why = "B"', 'why = "A"')


def numpy_scalars(nb):
    """Task 4.3 (a): errors returned as NumPy scalars, not plain floats."""
    replace_in_cell(nb, "task-4-3-errors", 'fp32.append(float(rel_error(tc.gemm_emulated(A, B, acc="float32"), ref)))',
             'fp32.append(np.float64(rel_error(tc.gemm_emulated(A, B, acc="float32"), ref)))')


def no_swizzle(nb):
    """Task 4.4 (a): the swizzle bits left out, so wgmma would read the tiles as unswizzled: every descriptor,
    and so (b)'s too, is wrong."""
    replace_in_cell(nb, "task-4-4-descriptor", "    return fields | 1 << 62\n", "    return fields\n")


def no_upper_bound(nb):
    """Task 4.4 (a): an offset of 2**18 accepted, which spills into the next field; only the hidden test sees it."""
    replace_in_cell(nb, "task-4-4-descriptor", "if value < 0 or value % 16 or value >= 2**18:",
                    "if value < 0 or value % 16:")


def swapped_offsets(nb):
    """Task 4.4 (b): the leading and stride offsets given the other way round: (a) is right, and the visible test of
    (b) catches the first descriptor."""
    replace_in_cell(nb, "task-4-4-steps", "smem_descriptor(0x1000 + 32 * kk, 16, 1024)",
                    "smem_descriptor(0x1000 + 32 * kk, 1024, 16)")


def step_in_bytes(nb):
    """Task 4.4 (b): the step given in bytes, not in the address field's 16-byte units."""
    replace_in_cell(nb, "task-4-4-steps", "step = k_descriptors[1] - k_descriptors[0]", "step = 32")


def fp16_config(nb):
    """Task 4.5: the FP16-accumulating twin of the right tile: the same shared memory and intensity (the prediction's
    point), not an FP32 configuration (the decision's)."""
    replace_in_cell(nb, "task-4-5-answers", 'MY_CONFIG = "wmma_tiled_128x256x32_w64x64_s3_f32"',
                    'MY_CONFIG = "wmma_tiled_128x256x32_w64x64_s3_f16"')


def smem_without_padding(nb):
    """Task 4.5: the right tile, its shared memory predicted without the 8 elements of padding per row."""
    replace_in_cell(nb, "task-4-5-answers", "predicted_smem = 3 * (128 * (32 + 8) + 32 * (256 + 8)) * 2",
                    "predicted_smem = 3 * (128 * 32 + 32 * 256) * 2")


# variant -> the tests it fails (all others pass)


class TestExercises(LessonExercises):
    LESSON = "04_tensor_cores"
    NOTEBOOK = "tensor_cores.ipynb"
    TIMEOUT = 60  # seconds per cell: the slowest, Task 4.1's hidden sizes in the simulator, takes about ten
    POINTS = {"test_4_1_results": 3, "test_4_1_loads": 1, "perf_4_1_tiled": 2,
              "test_4_2_compiles": 1, "test_4_2_emulated": 2, "perf_4_2_results": 1, "perf_4_2_speed": 2,
              "test_4_3_errors": 2, "test_4_3_exponent": 2, "test_4_3_exponents": 1, "test_4_3_ratio": 1,
              "test_4_3_why": 1, "test_4_4_descriptor": 2, "test_4_4_steps": 1,
              "test_4_5_prediction": 1, "test_4_5_decision": 1}
    VARIANTS = {
        no_second_barrier: ["test_4_1_results"],
        products_from_global: ["test_4_1_loads"],
        uncoalesced_w: ["test_4_1_loads"],
        wrong_b_pointer: ["test_4_2_emulated"],
        b_read_as_transposed: ["test_4_2_emulated"],
        row_major_a: ["test_4_2_compiles", "test_4_2_emulated"],
        endpoint_slope: ["test_4_3_exponent"],
        linear_explanation: ["test_4_3_why"],
        numpy_scalars: ["test_4_3_errors"],
        no_swizzle: ["test_4_4_descriptor", "test_4_4_steps"],
        no_upper_bound: ["test_4_4_descriptor"],
        step_in_bytes: ["test_4_4_steps"],
        swapped_offsets: ["test_4_4_steps"],
        fp16_config: ["test_4_5_decision"],
        smem_without_padding: ["test_4_5_prediction"],
    }
    UNANSWERED = {"test_4_1_results": "NotImplementedError", "test_4_1_loads": "NotImplementedError",
                  "test_4_3_errors": "NotImplementedError", "test_4_3_exponent": "NotImplementedError",
                  "test_4_2_compiles": "NameError", "test_4_2_emulated": "NameError", "test_4_4_descriptor": "NotImplementedError",
                  "test_4_4_steps": "NameError", "test_4_5_prediction": "NameError", "test_4_5_decision": "NameError"}
    ANSWERS = ['("col_major", "row_major")', "k * N + ti * 16", "swt[tx, ty] = W[w_row", "np.polyfit", 'why = "B"', "(value >> 4) << shift", "0x1000 + 32 * kk",
               'MY_CONFIG = "wmma_tiled_128x256x32']

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "cuda.syncthreads()" in message("no_second_barrier", "test_4_1_results")
        assert "elements from global memory" in message("products_from_global", "test_4_1_loads")
        assert "coalesced" in message("uncoalesced_w", "test_4_1_loads")
        assert "max |dW - ref|" in message("wrong_b_pointer", "test_4_2_emulated")
        assert "FP32 accumulation allows" in message("b_read_as_transposed", "test_4_2_emulated")
        assert "column-major" in message("row_major_a", "test_4_2_compiles")  # a hidden test
        assert "least-squares slope" in message("endpoint_slope", "test_4_3_exponent")  # a hidden test
        assert "return plain floats" in message("numpy_scalars", "test_4_3_errors")
        assert "want 0x4000004000010040" in message("no_swizzle", "test_4_4_descriptor")
        assert "must raise ValueError" in message("no_upper_bound", "test_4_4_descriptor")  # a hidden test
        assert "16-byte units" in message("step_in_bytes", "test_4_4_steps")
        assert "want 0x4000004000010100" in message("swapped_offsets", "test_4_4_steps")
        assert "accumulates in FP16" in message("fp16_config", "test_4_5_decision")  # a hidden test
        assert "81,408 bytes" in message("smem_without_padding", "test_4_5_prediction")
