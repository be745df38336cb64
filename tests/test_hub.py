"""A class on JupyterHub with nbgrader's exchange, end to end on this machine's loopback: the hub that
``python -m gpucourse hub`` starts (its proxy is Node.js' configurable-http-proxy), real system users (an
instructor and four students, made here with useradd and removed afterwards) who log in with PAM, the
students' servers (the course's JupyterLab with nbgrader's extension, run as each student), and nbgrader's
exchange in a shared folder set up as nbgrader documents it.

The instructor runs nbgrader's and the course's commands as their own user (``runuser``), as they would in a
terminal of their JupyterLab; students act through their servers behind the hub's proxy with their own API
tokens, calling what JupyterLab calls (the contents API to save a notebook, nbgrader's Assignments
handlers to fetch, submit and fetch feedback). One student does it in Chromium, clicking Fetch and Submit in
JupyterLab's Assignments panel (``test_a_student_fetches_and_submits_in_the_browser``).

Needs root (users are made and servers run as them), configurable-http-proxy (``npm install -g
configurable-http-proxy``; ``.ci/run`` installs it) and JupyterHub (the ``test`` extra); skipped, saying which
is missing, otherwise. The browser test also needs /usr/bin/chromium and playwright.
"""
from __future__ import annotations

import csv
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from exercise_variants import fill_in_exercise, replace_in_cell

pytestmark = [pytest.mark.slow, pytest.mark.lesson01]

ROOT = Path(__file__).resolve().parents[1]
LESSON = "01_vector_multiply"
NOTEBOOK = "vector_multiply.ipynb"
SOLUTION = ROOT / "solutions" / LESSON / NOTEBOOK
EXERCISE = ROOT / "exercises" / LESSON / NOTEBOOK
COURSE_FILES = ("nbgrader_config.py", "gpucourse", "kernels", "benchmarks", "solutions", "exercises")
MAX_SCORE = 15.0  # lesson 1: 12 points gradable in CPU mode, 3 performance points that need a GPU


def _prerequisites() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: the test makes system users and the hub starts their servers as them"
    for tool in ("useradd", "userdel", "runuser", "chpasswd", "pgrep"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if shutil.which("configurable-http-proxy") is None:
        return "configurable-http-proxy is not installed (npm install -g configurable-http-proxy; .ci/run does it)"
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "JupyterHub is not installed (pip install -e '.[test]')"
    if not (Path(sys.executable).parent / "jupyterhub-singleuser").exists():
        return f"jupyterhub-singleuser is not beside {sys.executable}"
    return None


# ------------------------------------------------------------------------------------------ helpers

def _request(url: str, token: str, *, method: str = "GET", body=None, timeout: float = 60) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"token {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


def _wait(what: str, check, *, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


class Classroom:
    """The hub, its users and folders; ``stop`` ends everything the test started."""

    def __init__(self, base: Path):
        self.base = base
        suffix = secrets.token_hex(3)
        self.instructor = f"gpc{suffix}-teach"
        # full marks, one answer wrong, blank; the fourth works in the browser
        self.students = {"full": f"gpc{suffix}-full", "part": f"gpc{suffix}-part", "blank": f"gpc{suffix}-blank",
                         "web": f"gpc{suffix}-web"}
        self.users: list[str] = []
        self.passwords: dict[str, str] = {}
        self.acl: list[str] = []
        self.exchange = base / "exchange"
        self.runtime = base / "hub"
        self.homes = base / "home"
        self.admin_token = secrets.token_hex(32)
        self.tokens: dict[str, str] = {}
        self.launcher: subprocess.Popen | None = None
        self.log = base / "hub.log"
        self.url = ""

    # -- users
    def home(self, user: str) -> Path:
        return self.homes / user

    def add_user(self, name: str) -> None:
        subprocess.run(["useradd", "--create-home", "--base-dir", str(self.homes), "--shell", "/bin/bash",
                        "--user-group", name], check=True, timeout=30, capture_output=True)
        self.users.append(name)
        os.chmod(self.home(name), 0o700)  # nobody else reads a user's work
        self.passwords[name] = secrets.token_urlsafe(12)
        subprocess.run(["chpasswd"], input=f"{name}:{self.passwords[name]}", text=True, check=True, timeout=30)
        self._reach_python(name)

    def _reach_python(self, name: str) -> None:
        """The course's Python must run as every user. Where it lies in a folder only root may enter (a
        pyenv Python under /root), let this user through that folder only (execute, no listing), with an
        ACL that stop() removes."""
        probe = subprocess.run(["runuser", "-u", name, "--", sys.executable, "-c", "pass"], capture_output=True,
                               timeout=60)
        if probe.returncode == 0:
            return
        real = Path(os.path.realpath(sys.executable))
        blocked = [p for p in reversed(real.parents) if not os.stat(p).st_mode & stat.S_IXOTH]
        if not blocked or shutil.which("setfacl") is None:
            pytest.skip(f"the course's Python ({real}) cannot run as another user, and setfacl is not there to let "
                        "the test's users reach it: install Python where every user may run it")
        for folder in blocked:
            subprocess.run(["setfacl", "-m", f"u:{name}:x", str(folder)], check=True, timeout=30)
            self.acl.append(f"{name}\0{folder}")
        probe = subprocess.run(["runuser", "-u", name, "--", sys.executable, "-c", "pass"], capture_output=True,
                               timeout=60)
        assert probe.returncode == 0, probe.stderr

    def as_user(self, user: str, *args: str, cwd: Path | None = None, timeout: float = 300,
                check: bool = True) -> subprocess.CompletedProcess:
        """A command run as ``user`` with their own HOME and the environment the hub gives their servers."""
        env = {"HOME": str(self.home(user)), "USER": user, "LOGNAME": user, "LANG": "C.UTF-8",
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
               "JUPYTER_CONFIG_PATH": str(self.runtime / "jupyter"), "GPUCOURSE_MODE": "cpu"}
        done = subprocess.run(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                               *args], cwd=cwd or self.home(user), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        if check:
            assert done.returncode == 0, f"{' '.join(args)} as {user} failed:\n{done.stdout}\n{done.stderr}"
        return done

    # -- the hub
    def start(self) -> None:
        from gpucourse.classroom import free_port

        token_file = self.base / "admin-token"
        token_file.write_text(self.admin_token)
        os.chmod(token_file, 0o600)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        students = ",".join(self.students.values())
        with open(self.log, "wb") as log:
            self.launcher = subprocess.Popen(
                [sys.executable, "-m", "gpucourse", "hub", "--instructor", self.instructor, "--students", students,
                 "--port", str(port), "--runtime", str(self.runtime), "--exchange", str(self.exchange),
                 "--api-token-file", str(token_file), "--mode", "cpu"],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        _wait("the hub started (python -m gpucourse hub)", lambda: self.launcher.poll() is not None
              or "The class's hub is up" in self.log.read_text(errors="replace"), timeout=150)
        assert self.launcher.poll() is None, "the hub did not start:\n" + self.log_tail()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def api(self, path: str, *, method: str = "GET", body=None):
        return _request(f"{self.url}/hub/api{path}", self.admin_token, method=method, body=body)

    def start_servers(self, users) -> None:
        """Start each user's JupyterLab through the hub's API and give each an API token of their own."""
        for user in users:
            status, reply = self.api(f"/users/{user}/server", method="POST")
            assert status in (201, 202), (status, reply, self.log_tail())
            status, reply = self.api(f"/users/{user}/tokens", method="POST", body={"note": "test_hub"})
            assert status == 201, (status, reply)
            self.tokens[user] = reply["token"]
        for user in users:
            _wait(f"{user}'s server became ready", lambda: (self.api(f"/users/{user}")[1] or {}).get(
                "servers", {}).get("", {}).get("ready"), timeout=150)

    def user_api(self, user: str, path: str, *, method: str = "GET", body=None, timeout: float = 120):
        """A request to ``user``'s own server through the hub's proxy, with ``user``'s token."""
        return _request(f"{self.url}/user/{user}{path}", self.tokens[user], method=method, body=body, timeout=timeout)

    def stop(self) -> list[str]:
        """Stop the hub (Ctrl-C to its launcher), then anything left; remove the users and their ACLs.
        Returns what had to be killed by force (nothing when the hub stopped everything)."""
        leftovers = []
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGINT)
            try:
                self.launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                leftovers.append(f"launcher {self.launcher.pid}")
                os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait(timeout=30)
        for pid_file in ("jupyterhub.pid", "jupyterhub-proxy.pid"):
            try:
                pid = int((self.runtime / pid_file).read_text())
                if str(self.runtime).encode() in Path(f"/proc/{pid}/cmdline").read_bytes() or \
                        b"configurable-http-proxy" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    leftovers.append(f"{pid_file[:-4]} {pid}")
            except (OSError, ValueError):
                pass
        for user in self.users:
            for _ in range(20):  # the users' processes: none should be left; end any that is, by its id
                pids = subprocess.run(["pgrep", "-u", user], capture_output=True, text=True).stdout.split()
                if not pids:
                    break
                leftovers.extend(f"{user}: {pid}" for pid in pids)
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.5)
        for entry in self.acl:
            user, folder = entry.split("\0")
            subprocess.run(["setfacl", "-x", f"u:{user}", folder], timeout=30)
        for folder in {entry.split("\0")[1] for entry in self.acl}:
            entries = subprocess.run(["getfacl", "-cp", folder], capture_output=True, text=True).stdout.split()
            if not any(e.split(":")[1] for e in entries if e.startswith(("user:", "group:"))):
                subprocess.run(["setfacl", "-b", folder], timeout=30)  # back to the plain mode it had
        for user in self.users:
            subprocess.run(["userdel", "--remove", user], capture_output=True, timeout=60)
            subprocess.run(["groupdel", user], capture_output=True, timeout=60)  # where userdel left it
        return leftovers


@pytest.fixture(scope="module")
def classroom():
    """Users, the hub with every student's server running, and lesson 1 released by the instructor through the
    exchange; everything stopped and removed afterwards (the test fails if something had to be killed)."""
    why = _prerequisites()
    if why:
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="gpucourse-hub-"))
    os.chmod(base, 0o755)
    room = Classroom(base)
    leftovers: list[str] = []
    try:
        room.homes.mkdir()
        for user in [room.instructor, *room.students.values()]:
            room.add_user(user)
        # The instructor's clone of the course, private to them.
        course = room.home(room.instructor) / "course"
        course.mkdir()
        for item in COURSE_FILES:
            src = ROOT / item
            if src.is_dir():
                shutil.copytree(src, course / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy(src, course / item)
        subprocess.run(["chown", "-R", f"{room.instructor}:{room.instructor}", str(course)], check=True, timeout=60)
        room.course = course
        room.start()
        room.start_servers(list(room.students.values()))
        # The instructor releases lesson 1: the course's exercises/ through the exchange.
        room.as_user(room.instructor, sys.executable, "-m", "nbgrader", "release_assignment", LESSON, cwd=course)
        yield room
    finally:
        leftovers = room.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftovers, f"processes left after the hub stopped: {leftovers}"


def _course_id() -> str:
    from gpucourse.classroom import course_id

    return course_id(ROOT)


def _edit(room: Classroom, user: str, edit) -> None:
    """What saving in JupyterLab does: read the notebook through the contents API, change it, PUT it back."""
    path = f"/api/contents/{LESSON}/{NOTEBOOK}"
    status, model = room.user_api(user, path)
    assert status == 200, (status, model)
    nb = nbformat.from_dict(model["content"])
    edit(nb)
    status, reply = room.user_api(user, path, method="PUT", body={"type": "notebook", "format": "json",
                                                                  "content": nb})
    assert status == 200, (status, reply)


def full_marks(nb):
    fill_in_exercise(nb, SOLUTION, EXERCISE)


def one_answer_wrong(nb):
    """Every answer filled in, but task 1.2 counts two arrays' traffic instead of three (test_1_2_gbps fails)."""
    fill_in_exercise(nb, SOLUTION, EXERCISE)
    replace_in_cell(nb, "task-1-2-gbps", "nbytes = 3 * n * itemsize", "nbytes = 2 * n * itemsize")


# `python -m gpucourse grade-class`, run as the instructor (not root): the graded notebooks must stay writable
# by their owner for the grader's verdicts.
GRADE_CLASS = """import sys
from gpucourse import cli
sys.exit(cli.main(sys.argv[1:]))
"""

EXPECTED = {"full": 12.0, "part": 10.0, "blank": 0.0, "web": 0.0}  # CPU mode: the 3 performance points not given


def _denied(room: Classroom, user: str, paths: list[Path]) -> dict[str, str]:
    """For each path, what ``user`` gets trying to read it (a file) or list it (a folder)."""
    code = ("import json, os, sys\nout = {}\nfor p in sys.argv[1:]:\n    try:\n"
            "        os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(1)\n        out[p] = 'read'\n"
            "    except OSError as e:\n        out[p] = type(e).__name__\nprint(json.dumps(out))")
    done = room.as_user(user, sys.executable, "-c", code, *map(str, paths))
    return json.loads(done.stdout)


def test_hub_config_from_the_template(tmp_path):
    """classroom/jupyterhub_config.py filled in as `python -m gpucourse hub` does is a JupyterHub config that
    keeps everything on the loopback and in the runtime folder, and lets only the class log in."""
    from traitlets.config.loader import PyFileConfigLoader

    from gpucourse import classroom, jupyter

    settings = {"runtime": str(tmp_path), "ip": "127.0.0.1", "port": 18000, "hub_port": 18001,
                "proxy_api_port": 18002, "proxy_command": "/usr/bin/configurable-http-proxy",
                "singleuser": "/venv/bin/jupyterhub-singleuser", "instructors": ["teach"], "students": ["ann", "bo"],
                "group": None, "api_token": None, "jupyter_config": str(tmp_path / "jupyter"), "course_code": None,
                "mode": "cpu", "lab_args": jupyter.lab_arguments(classroom.lab_settings_dir(tmp_path))}
    path = classroom.write_config(tmp_path, settings)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    c = PyFileConfigLoader(path.name, path=str(tmp_path)).load_config()
    assert (c.JupyterHub.ip, c.JupyterHub.port, c.JupyterHub.hub_ip) == ("127.0.0.1", 18000, "127.0.0.1")
    assert c.ConfigurableHTTPProxy.api_url == "http://127.0.0.1:18002"
    assert c.JupyterHub.db_url == f"sqlite:///{tmp_path}/jupyterhub.sqlite"
    assert c.Authenticator.admin_users == {"teach"} and c.Authenticator.allowed_users == {"teach", "ann", "bo"}
    assert "allow_all" not in c.Authenticator and "services" not in c.JupyterHub
    assert c.Spawner.cmd == ["/venv/bin/jupyterhub-singleuser"]
    assert c.Spawner.environment["JUPYTER_CONFIG_PATH"] == str(tmp_path / "jupyter")
    assert c.Spawner.environment["GPUCOURSE_MODE"] == "cpu" and "PYTHONPATH" not in c.Spawner.environment
    # the users' JupyterLab opens without the news prompt: its settings folder, readable by every user
    assert f"--LabApp.app_settings_dir={tmp_path / 'jupyter/lab/settings'}" in c.Spawner.args
    settings_dir = classroom.write_lab_settings(tmp_path)
    overrides = json.loads((settings_dir / "overrides.json").read_text())
    assert overrides[jupyter.NOTIFICATION]["fetchNews"] == "false"
    assert stat.S_IMODE((settings_dir / "overrides.json").stat().st_mode) == 0o644
    assert stat.S_IMODE(settings_dir.stat().st_mode) == 0o755
    nbgrader_config = classroom.write_nbgrader_config(tmp_path / "jupyter", tmp_path / "exchange", "the-course")
    n = PyFileConfigLoader(nbgrader_config.name, path=str(nbgrader_config.parent)).load_config()
    assert (n.Exchange.root, n.CourseDirectory.course_id) == (str(tmp_path / "exchange"), "the-course")
    assert classroom.course_id() == "gpu-programming-for-deep-learning"


@pytest.mark.slow
def test_a_student_fetches_and_submits_in_the_browser(classroom):
    """A student logs in on the hub's page with their password, opens Nbgrader > Assignment List in their
    JupyterLab, clicks Fetch on lesson 1 and then Submit (handing in the exercise unanswered)."""
    from test_jupyterlab_browser import CHROMIUM, CHROMIUM_ARGS

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (Debian: apt-get install chromium; .ci/run does it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    room, user = classroom, classroom.students["web"]
    shots = ROOT / "out" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{room.url}/hub/login", timeout=60_000)
            page.fill("#username_input", user)
            page.fill("#password_input", room.passwords[user])
            page.click("#login_submit")
            page.wait_for_url(f"**/user/{user}/lab**", timeout=120_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").wait_for(timeout=120_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").click()
            page.locator(".lm-Menu-itemLabel", has_text="Assignment List").click()
            released = page.locator("#released_assignments_list")
            released.get_by_text(LESSON).wait_for(timeout=60_000)
            try:
                released.get_by_role("button", name="Fetch").click()
                fetched = room.home(user) / LESSON / NOTEBOOK
                _wait("the fetched notebook in the student's home", fetched.exists, timeout=60)
                downloaded = page.locator("#fetched_assignments_list")
                downloaded.get_by_role("button", name="Submit").first.click()
                page.locator("#submitted_assignments_list").get_by_text(LESSON).wait_for(timeout=60_000)
            finally:
                page.screenshot(path=str(shots / "jupyterhub-assignments.png"))
        finally:
            browser.close()
    inbound = room.exchange / _course_id() / "inbound"
    assert [p for p in inbound.iterdir() if p.name.startswith(f"{user}+{LESSON}+")], list(inbound.iterdir())


@pytest.mark.slow
def test_class_on_jupyterhub(classroom):
    room = classroom
    course_id = _course_id()
    students = room.students
    started = time.monotonic()

    # Each student sees lesson 1 released and fetches it into their home (the browser student did, or does here).
    for role, user in students.items():
        status, listing = room.user_api(user, f"/assignments?course_id={course_id}")
        assert status == 200 and listing["success"], listing
        assert LESSON in {a["assignment_id"] for a in listing["value"]}, listing
        if role == "web" and (room.home(user) / LESSON).exists():
            continue
        status, listing = room.user_api(user, "/assignments/fetch", method="POST",
                                        body={"course_id": course_id, "assignment_id": LESSON})
        assert status == 200 and listing["success"], listing
        assert (room.home(user) / LESSON / NOTEBOOK).is_file()

    # The release holds no solution and no hidden test, in the exchange and in what students fetched.
    for notebook in [room.exchange / course_id / "outbound" / LESSON / NOTEBOOK,
                     room.home(students["blank"]) / LESSON / NOTEBOOK]:
        text = notebook.read_text()
        assert "HIDDEN" not in text and "BEGIN SOLUTION" not in text, notebook

    # Each answers differently, saves, and submits (the browser student may have submitted already).
    _edit(room, students["full"], full_marks)
    _edit(room, students["part"], one_answer_wrong)
    inbound = room.exchange / course_id / "inbound"
    for role, user in students.items():
        if role == "web" and any(p.name.startswith(f"{user}+") for p in inbound.iterdir()):
            continue
        status, listing = room.user_api(user, "/assignments/submit", method="POST",
                                        body={"course_id": course_id, "assignment_id": LESSON})
        assert status == 200 and listing["success"], listing

    # Each submission is in the exchange's inbound under a name no other student can guess (it ends in a random
    # string) in a folder they cannot list.
    names = sorted(p.name for p in inbound.iterdir())
    assert [n.split("+")[0] for n in names] == sorted(students.values()), names
    assert all(len(n.split("+")) == 4 and len(n.split("+")[3]) >= 12 for n in names), names
    assert stat.S_IMODE(inbound.stat().st_mode) & 0o007 == 0o003, oct(inbound.stat().st_mode)  # o=wx: no listing

    # No student can see another's work: not in the exchange's inbound, not in another's home; nor the
    # instructor's course (solutions, hidden tests, gradebook).
    blank, full = students["blank"], students["full"]
    course = room.course
    tried = _denied(room, blank, [inbound, room.home(full), room.home(full) / LESSON / NOTEBOOK, course,
                                  course / "solutions" / LESSON / NOTEBOOK, room.exchange / course_id / "outbound"])
    assert tried == {str(inbound): "PermissionError", str(room.home(full)): "PermissionError",
                     str(room.home(full) / LESSON / NOTEBOOK): "PermissionError", str(course): "PermissionError",
                     str(course / "solutions" / LESSON / NOTEBOOK): "PermissionError",
                     str(room.exchange / course_id / "outbound"): "read"}, tried

    # The instructor collects, grades with the course's grader into the gradebook, and releases feedback.
    room.as_user(room.instructor, sys.executable, "-m", "nbgrader", "collect", LESSON, cwd=course)
    submitted = sorted(p.name for p in (course / "submitted").iterdir())
    assert submitted == sorted(students.values())
    graded = room.as_user(room.instructor, sys.executable, "-c", GRADE_CLASS, "grade-class", "submitted",
                          "--assignment", LESSON, "--mode", "cpu", cwd=course, timeout=600)
    print(graded.stdout)
    with open(course / ".grading" / LESSON / "grades.csv") as f:
        scores = {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(f)}
    assert scores == {user: (EXPECTED[role], MAX_SCORE) for role, user in students.items()}, (scores, graded.stdout)
    assert (course / ".grading" / LESSON / "gradebook.db").is_file()
    room.as_user(room.instructor, sys.executable, "-m", "gpucourse", "release-feedback", LESSON, cwd=course)

    # The feedback folder in the exchange cannot be listed by students; each fetches their own feedback.
    assert _denied(room, blank, [room.exchange / course_id / "feedback"]) == {
        str(room.exchange / course_id / "feedback"): "PermissionError"}
    feedback = {}
    for role, user in students.items():
        status, listing = room.user_api(user, "/assignments/fetch_feedback", method="POST",
                                        body={"course_id": course_id, "assignment_id": LESSON})
        assert status == 200 and listing["success"], listing
        files = list((room.home(user) / LESSON / "feedback").glob(f"*/{NOTEBOOK[:-6]}.html"))
        assert len(files) == 1, files
        feedback[role] = files[0]
    for role, html in feedback.items():
        own = course / ".grading" / LESSON / "feedback" / students[role] / LESSON / f"{NOTEBOOK[:-6]}.html"
        assert html.read_bytes() == own.read_bytes(), f"{students[role]} fetched feedback that is not theirs"
        text = html.read_text()
        assert f"{NOTEBOOK[:-6]} (Score: {EXPECTED[role]} / {MAX_SCORE})" in text, (role, text[:3000])
    # The grader's verdict on each test, in each student's own feedback.
    verdicts = {role: re.findall(r"grader: (\S+) / (\S+), (passed|failed|not gradable here)", html.read_text())
                for role, html in feedback.items()}
    statuses = {role: sorted(v[2] for v in found) for role, found in verdicts.items()}
    assert statuses["full"] == ["not gradable here"] + ["passed"] * 9, verdicts["full"]
    assert statuses["part"] == ["failed", "not gradable here"] + ["passed"] * 8, verdicts["part"]
    assert ("0", "2", "failed") in verdicts["part"], verdicts["part"]
    assert statuses["blank"] == ["failed"] * 9 + ["not gradable here"], verdicts["blank"]
    assert "NotImplementedError" in feedback["blank"].read_text()
    # ... and cannot read another's.
    assert _denied(room, blank, [feedback["full"]]) == {str(feedback["full"]): "PermissionError"}

    summary = {students[r]: f"{EXPECTED[r]:g}/{MAX_SCORE:g}" for r in students}
    print(f"hub flow scores: {summary}; {time.monotonic() - started:.0f} s after the hub was up")
