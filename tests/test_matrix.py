"""The capability matrix (``python -m gpucourse matrix``, ``make matrix``): what it runs, with which environment per
run, the table it prints, and its refusal without a GPU. Its GPU runs are stood in for by a function that records
what it was asked (the runs themselves are notebooks.execute, which the lesson tests run in CPU mode); one test
runs real kernels, two at a time, to show that each gets its own environment."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import nbformat
import pytest

from gpucourse import cli, matrix, notebooks, runtime
from gpucourse.grading.reports import TestResult

ROOT = Path(__file__).resolve().parents[1]


def _notebook(folder: Path, name: str, source: str = "print('hello')") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    path = folder / name
    nbformat.write(nb, path)
    return path


class FakeGPU:
    """Stands in for notebooks.execute on a GPU: records each call (notebook, mode, the kernel's environment as
    notebooks.kernel_environment would make it) and fails the runs it is told to."""

    def __init__(self, fail=(), tests=None, seconds=1.5):
        self.calls, self.fail, self.tests, self.seconds = [], set(fail), tests or {}, seconds
        self.lock = threading.Lock()
        self.running = self.most = 0

    def __call__(self, path, *, mode, timeout, save_to, env):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.05)
        kernel = notebooks.kernel_environment(mode, env=env)
        cc = kernel.get(runtime.FAKE_CC_VARIABLE, "native")
        with self.lock:
            self.calls.append((Path(path).name, mode, cc, save_to))
            self.running -= 1
        key = (Path(path).name, cc)
        error = "cell 46: StopIteration: no WMMA row" if key in self.fail else ""
        tests = tuple(self.tests.get(key, ()))
        return notebooks.Outcome(str(path), mode, self.seconds, not error and all(t.status == "passed" for t in tests),
                                 error, (), tests, (), bool(tests))


def test_matrix_runs_every_notebook_at_every_capability_with_its_own_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "6.1")  # the caller's own setting must not reach any run
    a = _notebook(tmp_path / "notebooks", "01_a.ipynb")
    b = _notebook(tmp_path / "solutions" / "01_a", "a.ipynb")
    failing = TestResult("test_2_1", 0.0, 2.0, "failed", "AssertionError: 3 != 4")
    gpu = FakeGPU(fail={("01_a.ipynb", "7.5")}, tests={("a.ipynb", "8.0"): [failing]})
    lines = []
    m = matrix.run_matrix([a, b], ["7.5", "80", "native"], execute=gpu, say=lines.append, native="9.0",
                          gpu="NVIDIA H100 80GB HBM3")
    assert sorted((n, cc) for n, _, cc, _ in gpu.calls) == sorted(
        (n, cc) for n in ("01_a.ipynb", "a.ipynb") for cc in ("7.5", "8.0", "native"))
    assert {mode for _, mode, _, _ in gpu.calls} == {"gpu"}
    assert os.environ[runtime.FAKE_CC_VARIABLE] == "6.1"  # left as it was
    # a line per run as it goes, then the table: a row per notebook, a column per capability
    assert len([line for line in lines if line.startswith("[")]) == 6 and "6 runs in GPU mode" in lines[0]
    table = m.table().splitlines()
    assert table[0].split() == ["notebook", "7.5", "8.0", "native"]
    rows = {line.split()[0]: line for line in table[1:3]}
    assert set(rows) == {str(a), str(b)}
    assert rows[str(a)].split()[1:] == ["FAIL", "2", "s", "pass", "2", "s", "pass", "2", "s"]
    assert rows[str(b)].split()[1:] == ["pass", "2", "s", "FAIL", "2", "s", "pass", "2", "s"]
    assert f"FAIL {a} at 7.5: cell 46: StopIteration: no WMMA row" in table
    assert any(line.startswith(f"FAIL {b} at 8.0: 0 of 1 tests pass; test_2_1: AssertionError: 3 != 4")
               for line in table), table
    assert table[-1].startswith("6 runs: 4 pass, 2 FAIL; 9 s of notebook time in ") and "on NVIDIA H100" in table[-1]
    assert len(m.failed) == 2


def test_a_capability_above_the_gpu_is_not_faked(tmp_path):
    a = _notebook(tmp_path / "notebooks", "01_a.ipynb")
    gpu = FakeGPU()
    m = matrix.run_matrix([a], ["7.5", "8.9", "native"], execute=gpu, say=lambda line: None, native="8.0")
    assert sorted(cc for _, _, cc, _ in gpu.calls) == ["7.5", "native"]
    text = m.table()
    assert text.splitlines()[1].split()[1:] == ["pass", "2", "s", "n/a", "pass", "2", "s"]
    assert "n/a at 8.9: this GPU's compute capability is 8.0" in text and not m.failed


def test_jobs_run_at_once_and_lessons_that_share_the_gpu_run_alone(tmp_path):
    paths = [_notebook(tmp_path / "notebooks", f"0{i}_x.ipynb") for i in (1, 2, 3)]
    paths.append(_notebook(tmp_path / "notebooks", "08_feeding_the_gpu.ipynb"))
    gpu = FakeGPU()
    order = []
    m = matrix.run_matrix(paths, ["7.5", "8.6"], jobs=3, execute=gpu, say=order.append)
    assert gpu.most == 3 and not m.failed and m.jobs == 3
    runs = [line for line in order if line.startswith("[")]
    assert all("08_feeding_the_gpu" in line for line in runs[-2:])  # after the others, one at a time
    assert "(3 at a time)" in m.table().splitlines()[-1]


def test_save_writes_the_table_as_json_and_each_copy_under_its_capability(tmp_path):
    a = _notebook(tmp_path / "notebooks", "01_a.ipynb")
    gpu = FakeGPU(fail={("01_a.ipynb", "8.0")})
    out = tmp_path / "out"
    matrix.run_matrix([a], ["8.0", "native"], execute=gpu, say=lambda line: None, save=out, gpu="NVIDIA H200")
    assert sorted(str(s) for *_, s in gpu.calls) == sorted(str(out / cc) for cc in ("8.0", "native"))
    saved = json.loads((out / "matrix.json").read_text())
    assert saved["gpu"] == "NVIDIA H200" and saved["capabilities"] == ["8.0", "native"]
    assert [(r["cc"], r["ok"]) for r in saved["runs"]] == [("8.0", False), ("native", True)]
    assert saved["runs"][0]["error"].startswith("cell 46")


def test_a_matrix_run_in_parts_saves_one_table(tmp_path):
    """Where a machine limits how long one command runs, the matrix runs a part at a time into one folder: each
    part adds its runs to matrix.json (a run made again replaces the earlier), and the last prints them all."""
    a = _notebook(tmp_path / "notebooks", "01_a.ipynb")
    b = _notebook(tmp_path / "notebooks", "02_b.ipynb")
    out = tmp_path / "out"
    quiet = {"say": lambda line: None, "save": out, "gpu": "NVIDIA H100"}
    matrix.run_matrix([a], ["native", "8.0"], execute=FakeGPU(fail={("01_a.ipynb", "8.0")}), **quiet)
    matrix.run_matrix([b], ["7.5"], execute=FakeGPU(), **quiet)
    m = matrix.run_matrix([a], ["8.0"], execute=FakeGPU(), **quiet)  # fixed, and run again
    assert m.capabilities == ["7.5", "8.0", "native"] and m.notebooks == [str(a), str(b)]
    rows = m.table().splitlines()
    assert rows[1].split()[1:] == ["-", "pass", "2", "s", "pass", "2", "s"]
    assert rows[2].split()[1:] == ["pass", "2", "s", "-", "-"]
    assert rows[-1].startswith("3 runs: 3 pass, 0 FAIL, 3 not run") and not m.failed
    assert len(json.loads((out / "matrix.json").read_text())["runs"]) == 6
    # another GPU's matrix.json is not merged
    other = matrix.run_matrix([b], ["7.5"], execute=FakeGPU(), **{**quiet, "gpu": "NVIDIA A100"})
    assert other.notebooks == [str(b)] and other.capabilities == ["7.5"]


def test_each_kernel_gets_its_own_capability_when_several_run_at_once(tmp_path, monkeypatch):
    """Real kernels (CPU mode stands in for the GPU), two at a time: each prints the capability it was given."""
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "6.1")
    code = "import os\nprint('cc=' + os.environ.get('GPUCOURSE_FAKE_CC', 'native'), os.environ['GPUCOURSE_MODE'])"
    paths = [_notebook(tmp_path / "notebooks", f"0{i}_x.ipynb", code) for i in (1, 2)]
    out = tmp_path / "out"
    m = matrix.run_matrix(paths, ["7.5", "8.6", "native"], jobs=2, mode="cpu", timeout=120, save=out,
                          say=lambda line: None)
    assert not m.failed, m.table()
    for cc in ("7.5", "8.6", "native"):
        for p in paths:
            nb = nbformat.read(out / cc / p.name if p.is_absolute() else out / cc / p, as_version=4)
            assert nb.cells[0].outputs[0]["text"].strip() == f"cc={cc} cpu"
    assert os.environ[runtime.FAKE_CC_VARIABLE] == "6.1"


def test_matrix_refuses_in_cpu_mode(capsys):
    assert cli.main(["matrix", "--mode", "cpu", "notebooks/01_vector_multiply.ipynb"]) == 2
    assert "the capability matrix needs a GPU" in capsys.readouterr().err
    if runtime.is_gpu():
        return
    assert cli.main(["matrix", "notebooks/01_vector_multiply.ipynb"]) == 2
    err = capsys.readouterr().err
    assert "needs a GPU" in err and "python -m gpucourse run" in err
    assert cli.main(["matrix", "--cc", "turing"]) == 2
    assert "a compute capability looks like 7.5" in capsys.readouterr().err


def test_make_matrix_passes_capabilities_notebooks_and_jobs(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / ".installed").touch()  # newer than pyproject.toml: make sees the environment as set up

    def dry(*args):
        done = subprocess.run(["make", "-n", "--no-print-directory", "matrix", f"VENV={venv}", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert dry()[-3:] == ["-m", "gpucourse", "matrix"]  # make's own CC (the C compiler) is not a capability
    assert dry('CC=8.0 native', "NB=notebooks/01_vector_multiply.ipynb", "JOBS=2", "SAVE=/tmp/m")[-9:] == [
        "matrix", "--cc", "8.0", "native", "--jobs", "2", "--save", "/tmp/m", "notebooks/01_vector_multiply.ipynb"]


def test_notebooks_execute_leaves_this_process_environment_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    env = notebooks.kernel_environment("gpu", env={runtime.FAKE_CC_VARIABLE: "7.5", "GPUCOURSE_X": None})
    assert env[runtime.MODE_VARIABLE] == "gpu" and env[runtime.FAKE_CC_VARIABLE] == "7.5"
    assert "NUMBA_ENABLE_CUDASIM" not in env and str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "8.6")
    assert runtime.FAKE_CC_VARIABLE not in notebooks.kernel_environment("gpu", env={runtime.FAKE_CC_VARIABLE: None})
    assert os.environ[runtime.FAKE_CC_VARIABLE] == "8.6" and os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
