"""A class on JupyterHub with nbgrader's exchange: ``python -m gpucourse hub`` (``make hub``) starts the hub,
``python -m gpucourse release-feedback LESSON`` hands the grader's feedback to the exchange.

The route (README, "Classroom on JupyterHub"): the instructor releases a lesson from a clone of the course
(``nbgrader release_assignment``), students fetch and submit from JupyterLab's Assignments panel, the
instructor collects (``nbgrader collect``), grades with the course's grader (``python -m gpucourse grade-class
submitted``) and releases the feedback (``python -m gpucourse release-feedback``); students fetch their own.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import jupyter, runtime

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "classroom" / "jupyterhub_config.py"
DEFAULT_EXCHANGE = Path("/srv/nbgrader/exchange")  # nbgrader's documented default
DEFAULT_RUNTIME = REPO / ".hub"
_SETTINGS_LINE = "SETTINGS = {}  # filled in by gpucourse.classroom.write_config (python -m gpucourse hub)"


def course_id(course_dir: Path = REPO) -> str:
    """The course id in the course's nbgrader_config.py (the exchange files assignments under it)."""
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(course_dir)).load_config()
    return str(config.CourseDirectory.course_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_exchange(root: Path) -> Path:
    """nbgrader's exchange root as its documentation sets it up: owned by root, everyone may create their
    course folder in it (0777), and the sticky bit keeps anyone from removing another's (as /tmp)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(root, 0, 0)
    os.chmod(root, 0o1777)
    return root


def write_nbgrader_config(folder: Path, exchange: Path, course: str) -> Path:
    """The nbgrader_config.py every user's server reads (JUPYTER_CONFIG_PATH): the exchange and the course."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    path = folder / "nbgrader_config.py"
    path.write_text("# Written by python -m gpucourse hub: nbgrader's exchange for every user of the hub.\n"
                    "c = get_config()  # noqa: F821\n"
                    f"c.Exchange.root = {str(exchange)!r}\n"
                    f"c.CourseDirectory.course_id = {course!r}\n")
    os.chmod(path, 0o644)
    return path


def write_config(runtime_dir: Path, settings: dict) -> Path:
    """classroom/jupyterhub_config.py with SETTINGS filled in, written (private) into the runtime folder."""
    text = TEMPLATE.read_text()
    if text.count(_SETTINGS_LINE) != 1:
        raise runtime.CourseError(f"{TEMPLATE} must hold the line {_SETTINGS_LINE!r} once")
    path = runtime_dir / "jupyterhub_config.py"
    path.write_text(text.replace(_SETTINGS_LINE, f"SETTINGS = {settings!r}"))
    os.chmod(path, 0o600)
    return path


def _readable_by_others(path: Path) -> bool:
    """Whether a user other than its owner (and not in its group) can list ``path``."""
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in [path, *path.parents])
    except OSError:
        return False


def _check_users(names) -> None:
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            raise runtime.CourseInputError(f"no user {name!r} on this machine: create it first (useradd -m {name}; "
                                           f"passwd {name}), the hub starts each user's server as that user")


def hub_settings(*, runtime_dir: Path, exchange: Path, instructors, students=(), group: str | None = None,
                 ip: str = "127.0.0.1", port: int = 8000, api_token: str | None = None,
                 course_code: str | None = None, mode: str | None = None) -> dict:
    """What classroom/jupyterhub_config.py is filled in with (free ports for the hub's internal API and the
    proxy's API; the proxy and single-user server commands found beside this Python)."""
    proxy = shutil.which("configurable-http-proxy")
    if proxy is None:
        raise runtime.CourseError("configurable-http-proxy is not installed: npm install -g configurable-http-proxy "
                                  "(Node.js' proxy that JupyterHub puts in front of every server)")
    singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
    if not singleuser.exists():
        raise runtime.CourseError(f"{singleuser} is missing: install JupyterHub into the course's environment "
                                  "(pip install -e '.[test]', or pip install jupyterhub)")
    return {"runtime": str(runtime_dir), "ip": ip, "port": int(port), "hub_port": free_port(),
            "proxy_api_port": free_port(), "proxy_command": proxy, "singleuser": str(singleuser),
            "instructors": sorted(instructors), "students": sorted(students), "group": group,
            "api_token": api_token, "jupyter_config": str(runtime_dir / "jupyter"),
            "course_code": course_code, "mode": mode, "lab_args": jupyter.lab_arguments(lab_settings_dir(runtime_dir))}


def lab_settings_dir(runtime_dir: Path) -> Path:
    """Where the users' JupyterLab finds its application settings (``jupyter.write_lab_settings``: no news prompt)."""
    return Path(runtime_dir) / "jupyter" / "lab" / "settings"


def write_lab_settings(runtime_dir: Path) -> Path:
    """The users' JupyterLab application settings, readable by every user."""
    folder = jupyter.write_lab_settings(lab_settings_dir(runtime_dir))
    for path in [folder.parent, *folder.rglob("*"), folder]:
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return folder


def _hub_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/hub/api/", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(hub: subprocess.Popen, runtime_dir: Path, *, timeout: float = 30) -> None:
    """Stop the hub (it stops the users' servers and its proxy), then anything it left: its process group, and
    the proxy named in its pid file if that is still a configurable-http-proxy."""
    if hub.poll() is None:
        hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(hub.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    hub.wait()
    pid_file = runtime_dir / "jupyterhub-proxy.pid"
    try:
        pid = int(pid_file.read_text().strip())
        if b"configurable-http-proxy" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def start(settings: dict, *, stdout=None, timeout: float = 120) -> subprocess.Popen:
    """Write the config and start ``jupyterhub`` on it in its own session; return once its API answers."""
    runtime_dir = Path(settings["runtime"])
    config = write_config(runtime_dir, settings)
    url = f"http://{settings['ip']}:{settings['port']}"
    hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=runtime_dir,
                           stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                           start_new_session=True)
    deadline = time.monotonic() + timeout
    while not _hub_up(url):
        if hub.poll() is not None or time.monotonic() > deadline:
            stop(hub, runtime_dir)
            raise runtime.CourseError(f"JupyterHub did not start within {timeout:.0f} s (exit status {hub.returncode}); "
                                      "its log is above")
        time.sleep(0.5)
    return hub


def hub_cli(*, instructors, students=(), group=None, ip="127.0.0.1", port=8000, runtime_dir=None, exchange=None,
            api_token_file=None, course_code=None, mode=None) -> int:
    """``python -m gpucourse hub``: prepare the exchange and the runtime folder, start the hub, wait for Ctrl-C
    (or SIGTERM), then stop everything it started."""
    if os.geteuid() != 0:
        raise runtime.CourseError("the hub starts each user's server as that user, so it runs as root: "
                                  "sudo make hub ... (or sudo .venv/bin/python -m gpucourse hub ...)")
    if not instructors:
        raise runtime.CourseInputError("name the instructor(s): --instructor NAME")
    _check_users([*instructors, *students])
    if group:
        import grp

        try:
            grp.getgrnam(group)
        except KeyError:
            raise runtime.CourseInputError(f"no group {group!r} on this machine (groupadd {group}; "
                                           f"usermod -aG {group} NAME)") from None
    runtime_dir = Path(runtime_dir or DEFAULT_RUNTIME).resolve()
    runtime_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(runtime_dir, 0o711)  # users reach its jupyter/ folder, nobody lists or reads the rest
    exchange = prepare_exchange(Path(exchange or DEFAULT_EXCHANGE).resolve())
    token = Path(api_token_file).read_text().strip() if api_token_file else None
    settings = hub_settings(runtime_dir=runtime_dir, exchange=exchange, instructors=instructors, students=students,
                            group=group, ip=ip, port=port, api_token=token, course_code=course_code, mode=mode)
    write_nbgrader_config(Path(settings["jupyter_config"]), exchange, course_id())
    write_lab_settings(runtime_dir)
    if _readable_by_others(REPO / "solutions") and not course_code:
        print(f"warning: {REPO / 'solutions'} (solutions and hidden tests) is readable by every user of this machine, "
              "and students' servers import the course from this clone: for a class, run the hub from a clone "
              "without solutions/ and grade in the instructor's private one (README: Classroom on JupyterHub)",
              file=sys.stderr)

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C (SIGINT) and SIGTERM stop the class. SIGINT's handler is set here too, not left to Python: a process
    # started in the background of a script (nohup ... &, a CI job) inherits SIGINT ignored, and Python then keeps it
    # ignored, so Ctrl-C would do nothing and the hub would run on.
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    hub = None
    try:
        hub = start(settings)
        url = f"http://{settings['ip']}:{settings['port']}/"
        who = ", ".join([*(f"{i} (instructor)" for i in settings["instructors"]), *settings["students"],
                         *([f"the members of group {group}"] if group else [])])
        print(f"The class's hub is up: {url}  (exchange {exchange}, course {course_id()}; Ctrl-C stops it)\n"
              f"Who may log in, with their system password: {who}", flush=True)
        while hub.poll() is None:
            time.sleep(0.5)
        print(f"JupyterHub stopped (exit status {hub.returncode})", file=sys.stderr)
        return hub.returncode or 1
    except KeyboardInterrupt:
        print("stopping the hub and every user's server ...", flush=True)
        return 0
    finally:
        if hub is not None:
            stop(hub, runtime_dir)
            print("stopped", flush=True)


# ------------------------------------------------------------------------------------------ feedback

def release_feedback(assignment: str, *, course_dir=None, graded=None) -> list[str]:
    """Put the course grader's feedback (``grade-class``'s ``<graded>/feedback/<student>/<assignment>/``) into
    the course directory's ``feedback/`` with each collected submission's timestamp and secret (what
    nbgrader's exchange matches it to the student by), and run ``nbgrader release_feedback``. Returns the
    students whose feedback was released."""
    course_dir = Path(course_dir or REPO).resolve()
    graded = Path(graded or course_dir / ".grading" / assignment).resolve()
    source = graded / "feedback"
    if not source.is_dir():
        raise runtime.CourseInputError(f"no feedback in {graded}: grade the class first "
                                       f"(python -m gpucourse grade-class submitted --assignment {assignment})")
    released = []
    for student_dir in sorted(p for p in source.iterdir() if (p / assignment).is_dir()):
        student = student_dir.name
        submitted = course_dir / "submitted" / student / assignment
        missing = [n for n in ("timestamp.txt", "submission_secret.txt") if not (submitted / n).is_file()]
        if missing:
            raise runtime.CourseInputError(f"{submitted} lacks {', '.join(missing)}: release feedback for work "
                                           "collected from the exchange (nbgrader collect)")
        dest = course_dir / "feedback" / student / assignment
        dest.mkdir(parents=True, exist_ok=True)
        for html in (student_dir / assignment).glob("*.html"):
            shutil.copyfile(html, dest / html.name)
        for name in ("timestamp.txt", "submission_secret.txt"):
            shutil.copyfile(submitted / name, dest / name)
        released.append(student)
    if not released:
        raise runtime.CourseInputError(f"{source} holds no feedback for {assignment}")
    done = subprocess.run([sys.executable, "-m", "nbgrader", "release_feedback", assignment], cwd=course_dir,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        raise runtime.CourseError(f"nbgrader release_feedback failed:\n{done.stdout}{done.stderr}")
    return released


def release_feedback_cli(assignment: str, *, course_dir=None, graded=None) -> int:
    students = release_feedback(assignment, course_dir=course_dir, graded=graded)
    print(f"released feedback on {assignment} to the exchange for {len(students)} students: {', '.join(students)}")
    return 0
