"""Lesson 1: the kernels against their NumPy spec (simulator or GPU), bad input, CUDA C compiles."""
import numpy as np
import pytest

from conftest import needs_compiler
from gpucourse import runtime
from gpucourse import cuda_c
from kernels import vector_multiply as vm

pytestmark = pytest.mark.lesson01
cuda = runtime.cuda()


def device_operands(rng, n, dtype=np.float32):
    a = rng.standard_normal(n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    out = cuda.to_device(np.full(n, np.nan, dtype=dtype))  # poisoned: an unwritten element stays NaN
    return a, b, cuda.to_device(a), cuda.to_device(b), out


@pytest.mark.parametrize("kernel", ["one_per_thread", "grid_stride", "grid_stride_x4", "pairs"])
@pytest.mark.parametrize("n", [1, 31, 257, 3000])
def test_numba_kernels_match_spec(rng, kernel, n):
    a, b, da, db, dout = device_operands(rng, n)
    vm.multiply(da, db, dout, kernel=kernel, threads=128)
    np.testing.assert_array_equal(dout.copy_to_host(), vm.multiply_spec(a, b))


@pytest.mark.parametrize("blocks, threads", [(1, 1), (1, 32), (3, 64), (64, 256)])
def test_grid_stride_covers_any_grid(rng, blocks, threads):
    a, b, da, db, dout = device_operands(rng, 1000)
    vm.multiply(da, db, dout, blocks=blocks, threads=threads)
    np.testing.assert_array_equal(dout.copy_to_host(), vm.multiply_spec(a, b))


@pytest.mark.parametrize("kernel", ["grid_stride", "pairs"])
def test_float64(rng, kernel):
    a, b, da, db, dout = device_operands(rng, 501, np.float64)
    vm.multiply(da, db, dout, kernel=kernel)
    np.testing.assert_array_equal(dout.copy_to_host(), a * b)


@pytest.mark.parametrize("kernel", ["grid_stride_x4", "pairs"])
@pytest.mark.parametrize("blocks, threads", [(1, 1), (2, 32), (5, 64)])
def test_next_steps_cover_any_grid(rng, kernel, blocks, threads):
    """Four elements in flight and pairs: every element written once, whatever the grid, with the tails
    (a partial last round; the odd last element) handled."""
    for n in (999, 1000, 4 * 64 * 5 + 3):
        a, b, da, db, dout = device_operands(rng, n)
        vm.multiply(da, db, dout, kernel=kernel, blocks=blocks, threads=threads)
        np.testing.assert_array_equal(dout.copy_to_host(), a * b)


@pytest.mark.parametrize("n,blocks", [(2, None), (1000, None), (1000, 1), (4098, 3)])
def test_complex_multiply_matches_spec(rng, n, blocks):
    """The reference of the exercises' Task 1.4: the complex product of interleaved numbers, any grid."""
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    dout = cuda.to_device(np.full(n, np.nan, dtype=np.float32))
    vm.complex_multiply(cuda.to_device(a), cuda.to_device(b), dout, threads=32, blocks=blocks)
    want = (a.view(np.complex64) * b.view(np.complex64)).view(np.float32)
    np.testing.assert_allclose(dout.copy_to_host(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vm.complex_spec(a, b), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(runtime.CourseInputError, match="even length"):
        vm.complex_multiply(*(cuda.to_device(np.zeros(3, np.float32)) for _ in range(3)))


def test_pairs_view_and_alignment(rng):
    a, b, da, db, dout = device_operands(rng, 7)
    pairs = vm.as_pairs(da)
    assert pairs.shape == (3,) and np.dtype(pairs.dtype) == np.complex64
    np.testing.assert_array_equal(pairs.copy_to_host().view(np.float32), a[:6])
    with pytest.raises(runtime.CourseInputError, match="aligned to 8 bytes"):
        vm.multiply(da[1:], db[1:], dout[1:], kernel="pairs")


@pytest.mark.parametrize("make, message", [
    (lambda d, h: (h["a"], d["b"], d["out"]), "a must be a device array, got a host numpy.ndarray"),
    (lambda d, h: (d["a"], d["b"][:5], d["out"]), "b has shape (5,) but a has (10,)"),
    (lambda d, h: (d["a"], d["b"], d["out64"]), "out has dtype float64 but a has float32"),
    (lambda d, h: (d["int"], d["int"], d["int"]), "a must be float32 or float64, got int32"),
    (lambda d, h: (d["2d"], d["2d"], d["2d"]), "a must be 1-dimensional, got shape (2, 5)"),
])
def test_bad_input_is_named(make, message):
    h = {"a": np.ones(10, np.float32)}
    d = {"a": cuda.to_device(h["a"]), "b": cuda.to_device(h["a"]), "out": cuda.to_device(h["a"]),
         "out64": cuda.to_device(np.ones(10)), "int": cuda.to_device(np.ones(10, np.int32)),
         "2d": cuda.to_device(np.ones((2, 5), np.float32))}
    with pytest.raises(runtime.CourseInputError) as err:
        vm.multiply(*make(d, h))
    assert message in str(err.value)


def test_launch_configuration_is_checked(rng):
    _, _, da, db, dout = device_operands(rng, 1000)
    with pytest.raises(runtime.CourseInputError, match="cannot cover 1000 elements"):
        vm.multiply(da, db, dout, kernel="one_per_thread", blocks=2, threads=256)
    with pytest.raises(runtime.CourseInputError, match="threads per block must be 1..1024"):
        vm.multiply(da, db, dout, threads=2048)
    with pytest.raises(runtime.CourseInputError, match="kernel must be one of"):
        vm.multiply(da, db, dout, kernel="fastest")


def test_size_that_does_not_fit_is_refused():
    with pytest.raises(runtime.CourseInputError, match="GiB|MiB"):
        runtime.check_fits(2**50, "a petabyte of vectors")


@needs_compiler
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_c_compiles(arch):
    ptx = cuda_c.compile_ptx("vector_multiply", arch=arch)
    for kernel in vm.CUDA_C_VARIANTS + ("spin",):
        assert f".entry {kernel}(" in ptx
    assert "ld.global.nc.v4.f32" in ptx or "ld.global.v4.f32" in ptx  # the float4 loads are there


@needs_compiler
def test_compile_errors_are_reported(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k(float* a) { a[0] = undefined_name; }')
    monkeypatch.setattr(cuda_c, "SOURCES", tmp_path)
    with pytest.raises(runtime.CourseError, match="undefined_name"):
        cuda_c.compile_ptx("broken")


# ----------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("variant", vm.CUDA_C_VARIANTS)
@pytest.mark.parametrize("n", [1, 5, 1023, 2**20 + 3])
def test_cuda_c_kernels_match_spec(rng, variant, n):
    cp = runtime.cupy()
    a = cp.asarray(rng.standard_normal(n, dtype=np.float32))
    b = cp.asarray(rng.standard_normal(n, dtype=np.float32))
    out = cp.full(n, cp.nan, dtype=cp.float32)
    vm.multiply_cuda_c(a, b, out, variant=variant)
    np.testing.assert_array_equal(out.get(), a.get() * b.get())


@pytest.mark.gpu
def test_cuda_c_refuses_misaligned_and_host_input():
    cp = runtime.cupy()
    a = cp.ones(1025, dtype=cp.float32)
    with pytest.raises(runtime.CourseInputError, match="not 16-byte aligned"):
        vm.multiply_cuda_c(a[1:], a[1:], a[1:], variant="vmul_vec4")
    vm.multiply_cuda_c(a[1:], a[1:], cp.empty(1024, cp.float32), variant="vmul_grid_stride")
    with pytest.raises(runtime.CourseInputError, match="device array"):
        vm.multiply_cuda_c(np.ones(4, np.float32), a[:4], a[:4])


@pytest.mark.gpu
def test_numba_kernels_on_cupy_arrays(rng):
    cp = runtime.cupy()
    a = cp.asarray(rng.random(3 * 2**20 + 1, dtype=np.float32))
    out = cp.full_like(a, cp.nan)
    vm.multiply(a, a, out)
    cp.testing.assert_array_equal(out, a * a)


def test_recorded_numba_steps_on_h100():
    """Issue goal on an H100: the numba kernel learners reach (pairs) at >= 0.95 of the copy; the plain
    grid-stride loop below it; and what the sweep found: grid size matters, loads in flight do not at a
    full grid."""
    from gpucourse import records

    rec = records.latest("01_vector_multiply", gpu="NVIDIA H100 80GB HBM3")
    if rec is None or "numba" not in rec["figures"]:
        pytest.skip("no H100 record of lesson 1 with the numba sweep")
    rows = {r["name"]: r for r in rec["figures"]["kernels"]["rows"]}
    pairs = rows["numba, grid-stride, pairs (two adjacent elements a thread)"]
    assert pairs["of_copy"] >= 0.95
    assert pairs["gbps"] > rows["numba, grid-stride"]["gbps"]
    series = rec["figures"]["numba"]["series"]
    plain = series["grid_stride, 256 threads"]["gbps"]
    assert plain[0] < 0.5 * max(plain)  # one block of 256 threads per SM cannot keep enough bytes in flight
    x4 = series["grid_stride_x4, 256 threads"]["gbps"]
    assert x4[0] > 1.5 * plain[0]  # ... four loads in flight a thread help there
    assert max(series["pairs, 256 threads"]["gbps"]) > max(x4)


@pytest.mark.gpu
def test_lesson_benchmark_at_small_size():
    import benchmarks.vector_multiply as lesson

    table = lesson.kernel_table(n=2**22, repeats=3)
    assert {r["name"] for r in table["rows"]} >= {"numba, grid-stride", "cupy.multiply", "device-to-device copy"}
    for r in table["rows"]:
        assert r["median_ms"] > 0 and r["gbps"] > 0


# ------------------------------------------------------------------ the picture lesson 1 draws

def test_execution_model_draws_grid_warps_and_sms():
    """plots.execution_model: the grid's blocks, the marked block's warps with the marked thread and the index it
    computes, the SMs with the blocks they hold and the blocks that wait; offline, in either mode."""
    from matplotlib.patches import Rectangle

    from gpucourse import plots

    fig = plots.execution_model(blocks=10, threads_per_block=100, sms=4, blocks_per_sm=2, block=2, thread=37)
    top, mid, low = fig.axes
    texts = " | ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert sum(isinstance(p, Rectangle) for p in top.patches) == 10  # one box per block
    assert sum(isinstance(p, Rectangle) for p in mid.patches) == 4 * 32  # 100 threads: 4 warps of 32 lanes
    assert sum(p.get_hatch() == "////" for p in mid.patches) == 4 * 32 - 100  # lanes with no thread
    assert "cuda.grid(1) = blockIdx.x * blockDim.x + threadIdx.x = 2 * 100 + 37 = 237" in texts
    assert "threadIdx.x = 37 (warp 1, lane 5)" in texts and "warp 3: threadIdx.x 96..99" in texts
    assert all(f"SM {s}" in texts for s in range(4)) and "block 8, block 9" in texts  # 8 placed, 2 waiting
    assert sum(isinstance(p, Rectangle) for p in low.patches) == 4 + 8
    import matplotlib.pyplot as plt

    plt.close(fig)
    with pytest.raises(runtime.CourseInputError, match="marked thread must be in the grid"):
        plots.execution_model(blocks=2, threads_per_block=64, block=2)
    with pytest.raises(runtime.CourseInputError, match="1..1024 threads"):
        plots.execution_model(threads_per_block=2048)


# ------------------------------------------------------------ what the prose says, on every record

def _records_with(figure):
    from gpucourse import records

    recs = [r for r in records.all_records("01_vector_multiply") if figure in r["figures"]]
    if not recs:
        pytest.skip(f"no record of lesson 1 holds {figure!r}")
    return recs


def test_recorded_kernel_table_reads_as_the_lesson_says():
    """Notebook 01, section 8: the statements printed under the kernel table (lesson.reading) hold on every record;
    their words come from the relation each tests, so a reversed statement fails here."""
    from benchmarks import vector_multiply as lesson

    for rec in _records_with("kernels"):
        read = lesson.reading(rec["figures"]["kernels"])
        assert len(read) >= 5 and all(s for s, _ in read), rec["path"]
        failed = [s for s, ok in read if ok is not True]
        assert not failed, (rec["path"], failed)


def test_a_statement_is_written_from_the_relation_it_tests():
    from gpucourse import claims

    assert claims.compare("cupy.multiply", "below", "the copy", 0.6, 1.0, 0.05) == ("cupy.multiply: below the copy", True)
    assert claims.compare("cupy.multiply", "above", "the copy", 0.6, 1.0, 0.05) == ("cupy.multiply: above the copy", False)
    assert claims.compare("x4", "no faster than", "float4", 101, 100, 0.02)[1] is True
    assert claims.compare("x4", "no faster than", "float4", 110, 100, 0.02)[1] is False
    assert claims.compare("a", "level with", "b", lambda: {}["missing"], 1.0) == ("a: level with b", None)
    with pytest.raises(ValueError):
        claims.compare("a", "beats", "b", 1, 2)


def test_recorded_grid_sweep_best_grid_differs_between_kernels():
    """Notebook 01: 'the answer differs between the scalar kernel and the float4 one'."""
    for rec in _records_with("grids"):
        series = rec["figures"]["grids"]["series"]
        best = {k: int(np.argmax(v["gbps"])) for k, v in series.items()}
        assert best["vmul_grid_stride"] != best["vmul_vec4"], rec["path"]


def test_recorded_size_sweep_small_vectors_pay_the_launch():
    """Notebook 01: small vectors are dominated by the launch, and numba's launch costs more than CuPy's."""
    for rec in _records_with("sweep"):
        gbps = rec["figures"]["sweep"]["gbps"]
        assert gbps["numba, grid-stride"][0] < gbps["cupy.multiply"][0], rec["path"]
        assert all(v[0] < 0.1 * max(v) for v in gbps.values()), rec["path"]


def test_recorded_transfers_and_timing_read_as_the_lesson_says():
    """Notebook 01, sections 6 and 7: pinned copies beat pageable ones; even pinned they move data at a small
    fraction of the kernel's rate; the unsynchronised host timer reads a small part of the kernel's time."""
    for rec in _records_with("transfers"):
        rows = {r["name"]: r for r in rec["figures"]["transfers"]["rows"]}
        kernel = rows["kernel (numba grid-stride)"]["gbps"]
        for direction in ("a, b host->device", "out device->host"):
            assert rows[f"{direction}, pinned"]["gbps"] > 2 * rows[f"{direction}, pageable"]["gbps"], rec["path"]
            assert rows[f"{direction}, pinned"]["gbps"] < 0.1 * kernel, rec["path"]
        launch = rec["figures"]["launch"]
        assert launch["wall_no_sync_ms"] < 0.5 * launch["events_ms"], rec["path"]


def test_recorded_utilisation_is_the_same_reading_for_different_work():
    """Notebook 01, section 9: one block on one SM and blocks on every SM read (nearly) the same utilisation, for
    very different work; on a GPU that nothing else is using the idle line reads zero or close to it."""
    for rec in _records_with("utilisation"):
        u = rec["figures"]["utilisation"]
        assert abs(u["one_block_pct"] - u["every_sm_pct"]) <= 10 and u["work_ratio"] > 10, rec["path"]
        assert u["idle_pct"] <= 5, rec["path"]


def test_recorded_numba_sweep_lessons_of_the_deep_dive():
    """Notebook 01's deep dive, 'Lessons learned', on every record: one block of 256 threads per SM reaches well
    under half the copy and from 8 blocks per SM on more change next to nothing; four loads in flight more than
    double the rate at one block per SM and add next to nothing at a full SM; the pairs kernel comes within a
    few hundredths of the copy, below the CUDA C float4 kernel."""
    for rec in _records_with("numba"):
        kernels = rec["figures"]["kernels"]
        copy = kernels["copy_gbps"]
        series = rec["figures"]["numba"]["series"]
        per_sm = series["grid_stride, 256 threads"]["per_sm"]
        plain = np.array(series["grid_stride, 256 threads"]["gbps"]) / copy
        x4 = np.array(series["grid_stride_x4, 256 threads"]["gbps"]) / copy
        full, most = per_sm.index(8), per_sm.index(32)
        where = rec["path"]
        assert plain[0] < 0.5 and abs(plain[most] - plain[full]) < 0.05, where
        assert x4[0] > 2 * plain[0], where
        assert abs(x4[full] - plain[full]) <= 0.05 and abs(x4[most] - plain[most]) <= 0.05, where
        rows = {r["name"]: r for r in kernels["rows"]}
        pairs = rows["numba, grid-stride, pairs (two adjacent elements a thread)"]
        assert pairs["of_copy"] >= 0.95 and pairs["gbps"] < rows["CUDA C, float4"]["gbps"], where


READINGS = {"kernels": "reading", "grids": "grid_reading", "sweep": "sweep_reading",
            "transfers": "transfer_reading", "launch": "launch_reading", "utilisation": "utilisation_reading"}


@pytest.mark.parametrize("figure", READINGS)
def test_recorded_statements_printed_by_the_notebook_hold(figure):
    """Notebook 01 prints its comparisons of figures (sections 6 to 9) from these readings, under the figures
    they read; on every record each statement holds. Their words come from the relation each tests, so a
    comparison reversed in the code fails here."""
    from benchmarks import vector_multiply as lesson

    for rec in _records_with(figure):
        read = getattr(lesson, READINGS[figure])(rec["figures"][figure])
        assert read and all(s and len(s) <= 93 for s, _ in read), rec["path"]
        failed = [s for s, ok in read if ok is not True]
        assert not failed, (rec["path"], figure, failed)


def test_reversed_figures_print_the_statements_as_not_holding():
    """The same statements on figures made to read the other way: each printed line says NO, and a figure that is
    missing prints '-' rather than failing."""
    from benchmarks import vector_multiply as lesson
    from gpucourse import claims

    transfers = {"rows": [{"name": "a, b host->device, pageable", "gbps": 50.0},
                          {"name": "a, b host->device, pinned", "gbps": 10.0},
                          {"name": "out device->host, pageable", "gbps": 50.0},
                          {"name": "out device->host, pinned", "gbps": 10.0},
                          {"name": "kernel (numba grid-stride)", "gbps": 20.0}]}
    launch = {"wall_no_sync_ms": 3.0, "wall_sync_ms": 6.0, "events_ms": 2.0}
    util = {"idle_pct": 40.0, "one_block_pct": 10.0, "every_sm_pct": 100.0, "one_block_gflop": 100.0,
            "every_sm_gflop": 200.0}
    grids = {"series": {"vmul_grid_stride": {"blocks": [1, 2, 4], "gbps": [1, 2, 3]},
                        "vmul_vec4": {"blocks": [1, 2, 4], "gbps": [3, 2, 1]}}}
    sweep = {"sizes": [10, 100], "gbps": {"numba, grid-stride": [50.0, 60.0], "cupy.multiply": [7.0, 60.0]}}
    read = (lesson.transfer_reading(transfers) + lesson.launch_reading(launch) + lesson.utilisation_reading(util)
            + lesson.grid_reading(grids) + lesson.sweep_reading(sweep))
    assert len(read) == 13 and all(ok is False for _, ok in read), read
    assert all(line.startswith(" NO  ") for line in claims.lines(read).splitlines())
    rec = _records_with("transfers")[0]["figures"]
    assert claims.lines(lesson.launch_reading(rec["launch"])).splitlines()[0].startswith("yes  host timer")
    assert lesson.launch_reading({"events_ms": 1.0})[0][1] is None
    assert claims.lines(lesson.launch_reading({"events_ms": 1.0})).startswith("  -  ")
