"""Lesson 10's graded exercises through the real grader: the solution earns every point CPU mode can grade, the
released exercise none, and known-wrong answers exactly the points their mistakes leave them. Runs in CPU mode
(the numba kernels in the simulator, the Triton kernels of Tasks 10.6 and 10.7 in Triton's interpreter where PyTorch is
installed), where the performance tests are "not gradable here"; without PyTorch, the tests of Tasks 10.6 and 10.7 are
"not gradable here (needs software this machine lacks)" too. The GPU side is checked by running the solution notebook on a GPU."""
from __future__ import annotations

import pytest
from exercise_variants import LessonExercises, replace_in_cell


pytestmark = [pytest.mark.lesson10, pytest.mark.slow]


def merge_without_rescale(nb):
    """Task 10.1: the two parts' outputs averaged as they are, not weighted by their shares of the sum."""
    replace_in_cell(nb, "task-10-1-merge", "return L, w1[:, None] * y1 + w2[:, None] * y2", "return L, (y1 + y2) / 2")


def lse_through_exp(nb):
    """Task 10.1: L as log(exp(L1) + exp(L2)): right until the scores reach the hundreds, where exp overflows."""
    replace_in_cell(nb, "task-10-1-merge", "L = np.logaddexp(L1, L2)", "L = np.log(np.exp(L1) + np.exp(L2))")


def softmax_without_max(nb):
    """Task 10.2: exp(x) without the max subtracted: right on small values, overflows on the large row."""
    replace_in_cell(nb, "task-10-2-kernel", "shift = np.float32(0.0) if top == -np.inf else top", "shift = np.float32(0.0)")


def no_row_guard(nb):
    """Task 10.2: the rows past the end of the last block read as if they were there: out of bounds."""
    replace_in_cell(nb, "task-10-2-kernel", "live = row < x.shape[0]", "live = True")


def forgets_rescale(nb):
    """Task 10.3: the running sum is rescaled when the max grows, the output is not."""
    replace_in_cell(nb, "task-10-3-kernel", "            for j in range(d):\n                acc[j] *= alpha\n", "")


def causal_loads_everything(nb):
    """Task 10.4: every block loads every tile, mask or not."""
    replace_in_cell(nb, "task-10-4-tiles", "last_key = min(n, (b + 1) * block_m) if causal else n", "last_key = n")


def sum_not_rescaled(nb):
    """Task 10.6: the running max is updated and the output rescaled, but the running sum is not: wrong wherever a
    later tile raises a row's max (W = 1, one key a row, stays right)."""
    replace_in_cell(nb, "task-10-6-kernel", "l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")


def window_off_by_one(nb):
    """Task 10.6: the window's lower edge off by one (j >= i - W): every query sees W + 1 keys, W = 1 two."""
    replace_in_cell(nb, "task-10-6-kernel", "(behind >= 0) & (behind < WINDOW)", "(behind >= 0) & (behind <= WINDOW)")


def no_empty_row_guard(nb):
    """Task 10.6: the max subtracted as it is: a row that sees none of the first tile's keys (the window's lower
    edge) computes exp2(-inf - (-inf)) = NaN."""
    replace_in_cell(nb, "task-10-6-kernel", 'shift = tl.where(m_new == float("-inf"), 0.0, m_new)', "shift = m_new")


def lo_rounded_up(nb):
    """Task 10.6: the first tile rounded up instead of down: the keys of the window before it are skipped (right only
    where the window's first key starts a tile, as with W = 1)."""
    replace_in_cell(nb, "task-10-6-kernel", "tl.maximum(start_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N",
                    "tl.cdiv(tl.maximum(start_m * BLOCK_M - WINDOW + 1, 0), BLOCK_N) * BLOCK_N")


def loops_over_every_tile(nb):
    """Task 10.6: every tile of keys loaded, the masks alone keeping the window: right, so it keeps every point CPU
    mode grades; on a GPU it takes about 8 times the reference's time at W = 385, N = 4096 (perf_10_6_window, about
    0.4 of 2 points), which only a GPU run shows."""
    replace_in_cell(nb, "task-10-6-kernel", "hi = tl.minimum((start_m + 1) * BLOCK_M, N)", "hi = N\n    lo = 0")


def forgets_delta(nb):
    """Task 10.7: dS = P o dP, the D of the softmax's Jacobian left out: dV stays right, dK is wrong everywhere (at
    W = 1 it should be 0)."""
    replace_in_cell(nb, "task-10-7-kernel", "dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])",
                    "dsT = pT * tl.dot(v, tl.trans(do))")


def delta_in_float16(nb):
    """Task 10.7: D summed in float16, as O and dO are stored: off by about 1e-3, which dK's tolerance absorbs but
    D's own test does not."""
    replace_in_cell(nb, "task-10-7-kernel", "tl.load(O + at, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)",
                    "tl.load(O + at, mask=offs_m[:, None] < N, other=0.0)")
    replace_in_cell(nb, "task-10-7-kernel", "tl.load(DO + at, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)",
                    "tl.load(DO + at, mask=offs_m[:, None] < N, other=0.0)")


def dk_without_scale(nb):
    """Task 10.7: dK = dS^T Q without the scale of S = Q K^T scale (right only where dK is 0, W = 1)."""
    replace_in_cell(nb, "task-10-7-kernel", "    dk = dk * scale\n", "")


def backward_causal_only(nb):
    """Task 10.7: only the causal edge of the window masked (query i >= key j): right where W >= N, wrong elsewhere."""
    replace_in_cell(nb, "task-10-7-kernel", "(after >= 0) & (after < WINDOW)", "after >= 0")


def lse_as_log2(nb):
    """Task 10.7: the saved log-sum-exp subtracted from log2-unit scores as if it were a log2 too (it is a natural
    log): P wrong everywhere."""
    replace_in_cell(nb, "task-10-7-kernel", "tl.exp2(sT - lse[None, :] * 1.4426950408889634)", "tl.exp2(sT - lse[None, :])")


def tile_max_for_lse(nb):
    """Task 10.7: the forward's habit, each query's max over this tile subtracted instead of its log-sum-exp: P not
    normalised, and NaN for a query that sees none of the tile's keys (right only at W = 1, one key a query)."""
    replace_in_cell(nb, "task-10-7-kernel", "tl.exp2(sT - lse[None, :] * 1.4426950408889634)",
                    "tl.exp2(sT - tl.max(sT, 0)[None, :])")


def queries_end_at_the_keys(nb):
    """Task 10.7: the loop stops at the program's last key, as a causal forward's does: the later queries whose
    windows still hold these keys are missed (right only at W = 1)."""
    replace_in_cell(nb, "task-10-7-kernel", "(start_n + 1) * BLOCK_N - 1 + WINDOW", "(start_n + 1) * BLOCK_N")


def backward_over_every_tile(nb):
    """Task 10.7: every query tile loaded, the masks alone keeping the window: right, so it keeps every point CPU mode
    grades; on a GPU it takes about 8 times the reference's time at W = 385, N = 4096 (perf_10_7_backward), which only
    a GPU run shows."""
    replace_in_cell(nb, "task-10-7-kernel", "hi = tl.minimum((start_n + 1) * BLOCK_N - 1 + WINDOW, N)", "hi = N\n    lo = 0")


def counts_scores_bytes(nb):
    """Task 10.5: the bytes of S and P counted too, as if the scores went to memory."""
    replace_in_cell(nb, "task-10-5-cost", "return flops, 4.0 * batch * heads * n * d * itemsize",
                    "return flops, 4.0 * batch * heads * n * d * itemsize + 2.0 * batch * heads * n * n * itemsize")


class TestExercises(LessonExercises):
    LESSON = "10_attention"
    NOTEBOOK = "attention.ipynb"
    TIMEOUT = 120  # seconds per cell: Task 10.3's kernel in the simulator takes a few
    POINTS = {"test_10_1_merge": 2, "test_10_1_empty": 1, "test_10_2_softmax": 2, "test_10_2_minus_infinity": 1,
              "perf_10_2_softmax": 2, "test_10_3_output": 3, "test_10_3_lse": 1, "test_10_4_tiles": 2,
              "test_10_4_fraction": 1, "test_10_5_cost": 2, "test_10_5_ridge": 1, "test_10_5_measured": 1,
              "test_10_6_window": 3, "test_10_6_edges": 2, "perf_10_6_window": 2, "test_10_7_delta": 1,
              "test_10_7_window": 3, "test_10_7_edges": 2, "perf_10_7_backward": 2}
    VARIANTS = {
        merge_without_rescale: ["test_10_1_merge", "test_10_1_empty"],
        lse_through_exp: ["test_10_1_merge"],
        softmax_without_max: ["test_10_2_softmax"],
        no_row_guard: ["test_10_2_softmax", "test_10_2_minus_infinity"],
        forgets_rescale: ["test_10_3_output"],
        causal_loads_everything: ["test_10_4_tiles", "test_10_4_fraction"],
        counts_scores_bytes: ["test_10_5_cost", "test_10_5_ridge", "test_10_5_measured"],
        sum_not_rescaled: ["test_10_6_window", "test_10_6_edges"],
        window_off_by_one: ["test_10_6_window", "test_10_6_edges"],
        no_empty_row_guard: ["test_10_6_window", "test_10_6_edges"],
        lo_rounded_up: ["test_10_6_window", "test_10_6_edges"],
        loops_over_every_tile: [],
        forgets_delta: ["test_10_7_window", "test_10_7_edges"],
        delta_in_float16: ["test_10_7_delta"],
        dk_without_scale: ["test_10_7_window", "test_10_7_edges"],
        backward_causal_only: ["test_10_7_window", "test_10_7_edges"],
        lse_as_log2: ["test_10_7_window", "test_10_7_edges"],
        tile_max_for_lse: ["test_10_7_window", "test_10_7_edges"],
        queries_end_at_the_keys: ["test_10_7_window", "test_10_7_edges"],
        backward_over_every_tile: [],
    }
    UNANSWERED = {"test_10_1_merge": "NotImplementedError", "test_10_4_tiles": "NotImplementedError",
                  "test_10_5_cost": "NotImplementedError", "test_10_5_ridge": "NameError",
                  "test_10_5_measured": "NotImplementedError",
                  "test_10_6_window": "NotImplementedError", "test_10_6_edges": "NotImplementedError",
                  "test_10_7_delta": "NotImplementedError", "test_10_7_window": "NotImplementedError",
                  "test_10_7_edges": "NotImplementedError"}
    ANSWERS = ["np.logaddexp(L1, L2)", "live = row < x.shape[0]", "alpha = math.exp(m - tile_max)", "(b + 1) * block_m",
               "l_i * alpha + tl.sum(p, 1)", "acc * alpha[:, None]",
               "// BLOCK_N * BLOCK_N", "behind < WINDOW", "- 1 + WINDOW", "tl.sum(o * do, 1)", "after < WINDOW",
               "dk = dk * scale"]

    @classmethod
    def lacking(cls) -> set:
        """The tests of Tasks 10.6 and 10.7 where Triton cannot run here (no PyTorch for its interpreter, or no
        triton)."""
        from kernels.attention import triton_kernels as T

        return {g for g in cls.POINTS if g.startswith(("test_10_6", "test_10_7"))} if T.available() else set()

    def test_feedback_names_the_mistake(self, graded):
        def message(variant, grade_id):
            return graded[variant].test(grade_id).message

        assert "against the softmax of the whole row" in message("merge_without_rescale", "test_10_1_merge")
        assert "exp(L) overflows" in message("lse_through_exp", "test_10_1_merge")  # a hidden test
        assert "softmax_rows" in message("softmax_without_max", "test_10_2_softmax")
        assert "out of bounds" in message("no_row_guard", "test_10_2_softmax")
        assert "attention_forward's output" in message("forgets_rescale", "test_10_3_output")
        assert "the first block sees one tile, got 16" in message("causal_loads_everything", "test_10_4_tiles")
        assert "Q, K, V and O, once each" in message("counts_scores_bytes", "test_10_5_cost")
        assert "above your roofline" in message("counts_scores_bytes", "test_10_5_measured")
        if not self.lacking():
            assert "attention_kernel's output, W = 20" in message("sum_not_rescaled", "test_10_6_window")
            assert "attention_kernel's output, W = 1" in message("window_off_by_one", "test_10_6_edges")
            assert "(got nan" in message("no_empty_row_guard", "test_10_6_window")
            assert "W = 16, tiles 16 x 16" in message("lo_rounded_up", "test_10_6_edges")  # a hidden test
            assert "window_dkdv_kernel's dK, W = 20" in message("forgets_delta", "test_10_7_window")
            assert "window_dkdv_kernel's dK, W = 1" in message("forgets_delta", "test_10_7_edges")
            assert "delta_kernel's D, N = 40" in message("delta_in_float16", "test_10_7_delta")
            assert "window_dkdv_kernel's dK, W = 20" in message("dk_without_scale", "test_10_7_window")
            assert "window_dkdv_kernel's dV, W = 20" in message("backward_causal_only", "test_10_7_window")
            assert "window_dkdv_kernel's dV, W = 1" in message("lse_as_log2", "test_10_7_edges")
            assert "(got nan" in message("tile_max_for_lse", "test_10_7_window")
            assert "W = 16, tiles 16 x 16" in message("queries_end_at_the_keys", "test_10_7_edges")  # a hidden test
