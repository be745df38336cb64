"""Lesson 3: the memory kernels against their specs (simulator or GPU; shapes that are not whole blocks or tiles),
the sector and bank model on cases worked by hand, the hierarchy probes on a GPU, and the model and the text
against what the GPUs recorded."""
import numpy as np
import pytest

from gpucourse import records, runtime
from kernels import memory as mem
from kernels import memory_model as mm

pytestmark = pytest.mark.lesson03
cuda = runtime.cuda()
LESSON = "03_memory"
SHAPES = [(1, 1), (5, 7), (32, 32), (33, 40), (40, 33), (8, 70)]


def matrix(rng, shape):
    return rng.random(shape, dtype=np.float32)


# ------------------------------------------------------------------------- kernels in the simulator (or a GPU)

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(16, 16), (32, 8), (8, 32)])
def test_scale_both_ways_matches_spec(rng, shape, block):
    a = matrix(rng, shape)
    for swapped in (False, True):
        got = mem.scale(a, 3.0, swapped=swapped, block=block)
        assert isinstance(got, np.ndarray) and got.shape == a.shape
        np.testing.assert_array_equal(got, mem.scale_spec(a, 3.0))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", mem.VARIANTS)
def test_transposes_match_spec(rng, shape, variant):
    a = matrix(rng, shape)
    got = mem.transpose(a, variant=variant)
    assert got.shape == shape[::-1]
    np.testing.assert_array_equal(got, mem.transpose_spec(a))


def test_transpose_into_a_poisoned_device_output(rng):
    """Every element is written: an output filled with NaN first holds none afterwards."""
    a = matrix(rng, (45, 37))
    out = cuda.to_device(np.full((37, 45), np.nan, np.float32))
    mem.transpose(cuda.to_device(a), variant="padded", out=out)
    np.testing.assert_array_equal(out.copy_to_host(), a.T)


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (16, 16, 16), (17, 20, 18), (33, 5, 40), (8, 50, 3)])
@pytest.mark.parametrize("variant", mem.MATMULS)
def test_matmuls_match_spec(rng, m, k, n, variant):
    a, b = matrix(rng, (m, k)), matrix(rng, (k, n))
    got = mem.matmul(a, b, variant=variant)
    want = mem.matmul_spec(a, b)
    assert got.shape == (m, n)
    assert np.abs(got - want).max() <= mem.matmul_tolerance(k) * np.abs(want).max()


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (17, 30), (40, 33)])
def test_blur_matches_spec(rng, shape):
    img = matrix(rng, shape)
    np.testing.assert_allclose(mem.blur(img, block=(8, 8)), mem.blur_spec(img), rtol=1e-5)


def test_a_3x3_filter_matches_its_spec(rng):
    img = rng.random((13, 21), dtype=np.float32)
    got = mem.blur(img, weights=mem.GAUSSIAN_3X3, block=(8, 8))
    np.testing.assert_allclose(got, mem.blur_spec(img, mem.GAUSSIAN_3X3), rtol=1e-5)
    assert not np.allclose(got, mem.blur_spec(img), rtol=1e-3)  # not the mean
    with pytest.raises(runtime.CourseInputError):
        mem.blur(img, weights=np.ones(3))


def test_blur_spec_by_hand():
    img = np.zeros((3, 3), np.float32)
    img[0, 0] = 9.0
    want = np.array([[4, 2, 0], [2, 1, 0], [0, 0, 0]], np.float64)  # the corner pixel counts 4, 2 or 1 times
    np.testing.assert_allclose(mem.blur_spec(img), want)


@pytest.mark.parametrize("stride", [1, 2, 5, 32])
def test_strided_copy(rng, stride):
    n = 70
    src = rng.random(n * stride, dtype=np.float32)
    np.testing.assert_array_equal(mem.strided(src, n, stride), src[: n * stride : stride])


def test_grid_2d_covers_the_array():
    assert mem.grid_2d((100, 70), (32, 8)) == ((3, 13), (32, 8))
    assert mem.grid_2d((64, 64), (16, 16)) == ((4, 4), (16, 16))
    with pytest.raises(runtime.CourseInputError, match="1 to 1024 threads"):
        mem.grid_2d((10, 10), (64, 32))


def test_launchers_refuse_bad_input(rng):
    with pytest.raises(runtime.CourseInputError, match="float32"):
        mem.transpose(np.ones((4, 4), np.float64))
    with pytest.raises(runtime.CourseInputError, match="2-dimensional"):
        mem.scale(np.ones(4, np.float32), 2.0)
    with pytest.raises(runtime.CourseInputError, match="a's columns"):
        mem.matmul(matrix(rng, (3, 4)), matrix(rng, (5, 3)))
    with pytest.raises(runtime.CourseInputError, match="variant"):
        mem.transpose(matrix(rng, (3, 4)), variant="fast")
    with pytest.raises(runtime.CourseInputError, match="needs"):
        mem.strided(np.ones(10, np.float32), 5, 3)


# --------------------------------------------------------------------------------------- the model, by hand

def test_sectors_of_strided_warps():
    assert mm.sectors(mm.strided(1)) == 4  # 32 x 4 bytes = 128 bytes = 4 sectors
    assert mm.sectors(mm.strided(2)) == 8
    assert mm.sectors(mm.strided(8)) == 32  # one sector per lane from stride 8 on
    assert mm.sectors(mm.strided(32)) == 32
    assert mm.sectors(mm.strided(1), itemsize=8) == 8  # float64: 256 bytes
    assert mm.sectors(mm.strided(1, start=4)) == 5  # misaligned by 16 bytes: one sector more
    assert mm.sectors(np.zeros(32, int)) == 1  # all lanes on one element
    assert mm.sectors([0, 31], itemsize=1) == 1 and mm.sectors([31, 32], itemsize=1) == 2  # bytes
    assert mm.sectors([7], itemsize=8) == 1 and mm.sectors([3], itemsize=16) == 1
    assert [mm.stride_sectors(s) for s in (1, 2, 4, 8, 16, 32)] == [4, 8, 16, 32, 32, 32]


def test_rows_and_columns():
    assert mm.sectors(mm.row(1024)) == 4
    assert mm.sectors(mm.column(1024)) == 32
    assert mm.sectors(mm.block_warp((32, 8), 1024)) == 4
    assert mm.sectors(mm.block_warp((16, 16), 1024)) == 4  # two rows of 16 floats: 2 x 2 sectors
    assert mm.sectors(mm.block_warp((32, 8), 1024, swapped=True)) == 32  # 32 rows
    assert mm.sectors(mm.block_warp((16, 16), 1024, swapped=True)) == 16  # 16 rows x 2 neighbouring columns
    assert mm.sectors(mm.block_warp((8, 32), 1024, swapped=True)) == 8


def test_bank_conflicts_of_the_transpose_tile():
    assert mm.bank_conflict_ways(mm.tile_row(5)) == 1
    assert mm.bank_conflict_ways(mm.tile_column(0)) == 32  # 32 x 32 floats: a column is one bank
    assert mm.bank_conflict_ways(mm.tile_column(7, padded=True)) == 1  # rows of 33 words: 32 banks
    assert mm.bank_conflict_ways(mm.tile_row(5, padded=True)) == 1
    assert mm.bank_conflict_ways([0] * 32) == 1  # one word: a broadcast
    assert mm.bank_conflict_ways(np.arange(32) * 2) == 2  # stride 2 words: two words a bank
    assert mm.bank_conflict_ways([0, 32, 32, 64]) == 3
    assert mm.transpose_costs("naive") == {"global load sectors": 4, "global store sectors": 32}
    assert mm.transpose_costs("tiled") == {"global load sectors": 4, "shared store ways": 1, "shared load ways": 32,
                                           "global store sectors": 4}
    assert mm.transpose_costs("padded")["shared load ways"] == 1


def test_predictions():
    n = 32 * 1000
    p = mm.predict_strided_copy(n, 1, gbps=1000.0)
    assert p["bytes_moved"] == p["useful_bytes"] == 8 * n
    assert p["ms"] == pytest.approx(8 * n / 1e12 * 1e3) and p["useful_gbps"] == pytest.approx(1000.0)
    p = mm.predict_strided_copy(n, 32, gbps=1000.0)
    assert p["bytes_moved"] == 1000 * (32 + 4) * 32 and p["useful_gbps"] == pytest.approx(1000.0 * 8 / 36)
    naive, padded = mm.transpose_bytes(1024, 1024, "naive"), mm.transpose_bytes(1024, 1024, "padded")
    assert padded["bytes_moved"] == padded["useful_bytes"] == 8 * 1024**2
    assert naive["bytes_moved"] == 1024**2 // 32 * 36 * 32
    assert mm.predict_ms(2e9, 1000.0) == pytest.approx(2.0)
    t = mm.matmul_traffic(64, 64, 64, tile=16)
    assert t["bytes"] == 4 * (64 * 64 * 4 * 2 + 64 * 64) and t["flops"] == 2 * 64**3
    assert mm.matmul_traffic(64, 64, 64)["intensity"] < t["intensity"]


def test_model_refuses_nonsense():
    with pytest.raises(runtime.CourseInputError, match="1 to 32"):
        mm.sectors(np.arange(33))
    with pytest.raises(runtime.CourseInputError, match="negative"):
        mm.sectors([-1])
    with pytest.raises(runtime.CourseInputError, match="whole numbers"):
        mm.bank_conflict_ways([0.5])
    with pytest.raises(runtime.CourseInputError, match="naive"):
        mm.transpose_warp("fast", 32)


def test_chase_chain_is_one_cycle():
    nodes, spacing = 50, 4
    chain = mem.chase_chain(nodes, spacing)
    p, seen = 0, set()
    for _ in range(nodes):
        assert p % spacing == 0 and p not in seen
        seen.add(p)
        p = int(chain[p])
    assert p == 0 and len(seen) == nodes


# ----------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_kernels_on_cupy_arrays(rng):
    cp = runtime.cupy()
    a = matrix(rng, (300, 257))
    b = matrix(rng, (257, 130))
    da, db = cp.asarray(a), cp.asarray(b)
    for v in mem.VARIANTS:
        got = mem.transpose(da, variant=v)
        assert isinstance(got, cp.ndarray)
        np.testing.assert_array_equal(got.get(), a.T)
    for v in mem.MATMULS:
        want = mem.matmul_spec(a, b)
        assert np.abs(mem.matmul(da, db, variant=v).get() - want).max() <= mem.matmul_tolerance(257) * want.max()
    np.testing.assert_allclose(mem.blur(da).get(), mem.blur_spec(a), rtol=1e-5)
    np.testing.assert_array_equal(mem.scale(da, 2.0, swapped=True).get(), 2 * a)


@pytest.mark.gpu
def test_probes_give_sensible_numbers():
    cp = runtime.cupy()
    ghz = mem.clock_ghz()
    assert 0.3 < ghz < 3.5
    fma = mem.fma_chain(4096)
    assert 2 <= fma <= 12  # a few cycles
    shared = mem.chase(mem.chase_chain(1024, 1, xp=cp), steps=4096, shared=True)
    l1 = mem.chase(mem.chase_chain(64, 32, xp=cp), steps=4096, warm=256)
    l2 = mem.chase(mem.chase_chain(32768, 32, xp=cp), steps=4096, warm=32768)
    assert fma < shared < l2 and l1 < l2 and 10 < shared < 100, (fma, shared, l1, l2)
    x = cp.random.random(2**22, dtype=cp.float32)
    sink = mem.read_level(x, slice_vec=256, reps=3, shift=1, blocks=8)
    mem.shared_read(reps=16, blocks=4, sink=sink)
    assert float(sink.get()[0]) == 0.0  # the sums are never -1: nothing is written


def test_racy_transpose_is_only_a_race():
    """transpose_unsynced's one change is the missing barrier: with it back (transpose_padded) the result is right."""
    import inspect

    def source(kernel):
        return inspect.getsource(getattr(kernel, "py_func", None) or kernel.fn)  # numba.cuda, or its simulator

    racy, padded = source(mem.transpose_unsynced), source(mem.transpose_padded)
    body = lambda src: [ln for ln in src.split('"""')[2].splitlines() if ln.strip()]  # noqa: E731
    assert [ln for ln in body(padded) if "syncthreads" not in ln] == body(racy)


# ------------------------------------------------ the model and the text against what a GPU recorded (either mode)

@pytest.fixture(scope="module")
def record():
    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no GPU record of lesson 3 yet")
    return rec


def test_recorded_figures_read_as_the_lesson_says(record):
    """Every statement notebook 03 prints under a figure (benchmarks.memory.reading) holds in every record that holds
    the figure; every record holds the figures that are not optional (ncu's sectors and racecheck are)."""
    from benchmarks import memory as bm

    for rec in records.all_records(LESSON):
        for name, fig in bm.FIGURES.items():
            data = rec["figures"].get(name)
            if fig.optional and not (data or {}).get("available"):
                continue
            assert data, (rec["path"], f"no figure {name!r}")
            read = bm.reading(rec["figures"], name)
            assert read and all(s for s, _ in read), (rec["path"], name)
            failed = [s for s, holds in read if holds is not True]
            assert not failed, (rec["path"], name, failed)


def test_reading_reverses_with_the_figures():
    """The statements are tested, not written: figures that say the opposite turn them False, figures that lack
    what a statement needs turn it None (shown as "-"), and the words come from the relation tested."""
    from benchmarks import memory as bm

    assert all(holds is None for _, holds in bm.reading({}))
    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no GPU record of lesson 3 yet")
    import copy

    flipped = copy.deepcopy(rec["figures"])
    t = {r["variant"]: r for r in flipped["transposes"]["rows"]}
    t["padded"]["gbps"], t["naive"]["gbps"] = t["naive"]["gbps"], t["padded"]["gbps"]
    read = dict(bm.reading(flipped, "transposes"))
    assert read["tiled transpose: above naive"] is False
    assert read["padded transpose: above tiled (no bank conflicts)"] is False
    assert read["padded transpose: above half the copy's GB/s"] is False
    flipped["transposes"]["copy_gbps"] = t["padded"]["gbps"] / 1.01
    assert dict(bm.reading(flipped, "transposes"))["padded transpose: below the copy's GB/s"] is False
    m = {r["name"]: r for r in flipped["matmuls"]["rows"]}
    m["tiled"]["tflops"] = m["naive"]["tflops"]
    assert dict(bm.reading(flipped, "matmuls"))["tiled matmul's TFLOP/s: above 3x the naive one's"] is False


def test_recorded_transposes_and_matmuls(record):
    for rec in records.all_records(LESSON):
        f = rec["figures"]
        t = {r["variant"]: r for r in f["transposes"]["rows"]}
        assert t["padded"]["median_ms"] < t["tiled"]["median_ms"] < t["naive"]["median_ms"], rec["path"]
        assert t["tiled"]["shared_ways"] == 32 and t["padded"]["shared_ways"] == 1
        m = {r["name"]: r for r in f["matmuls"]["rows"]}
        assert m["tiled"]["median_ms"] < m["naive"]["median_ms"], rec["path"]
        assert all(r["rel_error"] <= mem.matmul_tolerance(f["matmuls"]["n"]) for r in m.values())


def test_recorded_latency_rises_level_by_level(record):
    for rec in records.all_records(LESSON):
        lat = rec["figures"]["hierarchy"]["latency"]
        ns = [lat[level]["ns"] for level in ("registers", "L1", "L2", "HBM")]
        assert ns == sorted(ns) and lat["shared memory"]["ns"] < lat["L2"]["ns"], rec["path"]


def test_recorded_strides_follow_the_model(record):
    """The model's sectors are what the sweep recorded beside it; the useful bandwidth falls as they grow; at strides
    4 and 8 (16 and 32 sectors a warp) the model's time at the copy ceiling is within 20% of the measured one, and
    from stride 16 on, where a warp's sectors are 64 bytes or more apart, the GPU takes longer than the model says
    (device memory moves them in pairs: the note's reading)."""
    for rec in records.all_records(LESSON):
        rows = rec["figures"]["strides"]["rows"]
        for r in rows:
            assert r["sectors"] == mm.stride_sectors(r["stride"])
        by = {r["stride"]: r for r in rows}
        gbps = [by[s]["gbps"] for s in (1, 2, 4, 8, 16)]
        assert all(a > b for a, b in zip(gbps, gbps[1:])), rec["path"]
        for s in (4, 8):
            assert 0.8 <= by[s]["gbps"] / by[s]["model_gbps"] <= 1.2, (rec["path"], s)
        for s in (16, 32):
            assert by[s]["gbps"] / by[s]["model_gbps"] < 0.8, (rec["path"], s)


def test_recorded_sectors_match_the_model(record):
    """Where ncu was reachable: sectors per request measured equal to the model's, and the shared-memory wavefronts
    of the tiled transpose's load 32 per instruction without padding and 1 with it."""
    held = [r for r in records.all_records(LESSON) if r["figures"].get("sectors", {}).get("available")]
    if not held:
        pytest.skip("no record holds ncu's sector counts")
    for rec in held:
        rows = {r["name"]: r for r in rec["figures"]["sectors"]["rows"]}
        for name, r in rows.items():
            model = r.get("model_load_sectors", r.get("model", {}).get("global load sectors"))
            assert r["load_sectors_per_request"] == pytest.approx(model, rel=0.02), (rec["path"], name)
        for v in ("naive", "tiled", "padded"):
            store = rows[v]["model"]["global store sectors"]
            assert rows[v]["store_sectors_per_request"] == pytest.approx(store, rel=0.02), (rec["path"], v)
        assert rows["tiled"]["shared_wavefronts_per_load"] == pytest.approx(32, rel=0.05)
        assert rows["padded"]["shared_wavefronts_per_load"] == pytest.approx(1, rel=0.05)


def test_recorded_racecheck_finds_the_race(record):
    held = [r for r in records.all_records(LESSON) if r["figures"].get("racecheck", {}).get("available")]
    if not held:
        pytest.skip("no record holds compute-sanitizer's racecheck")
    for rec in held:
        runs = rec["figures"]["racecheck"]["runs"]
        assert runs["unsynced"]["hazards"] > 0 and runs["padded"]["hazards"] == 0, rec["path"]
