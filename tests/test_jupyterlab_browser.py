"""JupyterLab in a real browser: the course's JupyterLab, started as the README's set-up installs it, serves
lesson 1 to headless Chromium (Debian's, driven by Playwright), opens without asking about Jupyter news, the probe
cell runs in a kernel and says which mode it is in, and nbgrader's JupyterLab extension is there (its menu in the page, its server extension
answering). A screenshot of the page is saved under out/. The server is stopped by its process id.

Needs /usr/bin/chromium (``.ci/run`` installs Debian's chromium when it runs as root) and the ``playwright``
package (the ``test`` extra); skipped, saying which is missing, otherwise.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gpucourse import cli, jupyter, runtime

pytestmark = [pytest.mark.slow, pytest.mark.lesson01]

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOK = "notebooks/01_vector_multiply.ipynb"
NEWS_PROMPT = "Would you like to get notified about official Jupyter news?"
SCREENSHOTS = ROOT / "out" / "screenshots"
# As the machine's own Chromium checks showed: no sandbox as root, no GPU, and none of Chromium's background
# connections, which a closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, str(exc)


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 with a token, serving a copy of lesson 1 (so that nothing the browser does, an
    autosave included, touches the repository's notebook); stopped by its process id afterwards."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (Debian: apt-get install chromium; .ci/run does it as root)")
    pytest.importorskip("playwright.sync_api",
                        reason="the playwright package is not installed (pip install -e '.[test]')")
    served = tmp_path / "served"
    (served / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / NOTEBOOK, served / NOTEBOOK)
    home = tmp_path / "home"
    token, port = secrets.token_hex(16), _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
               IPYTHONDIR=str(home / "ipython"), GPUCOURSE_MODE=runtime.get().mode)
    # The command `python -m gpucourse lab` runs (its JupyterLab settings: no news prompt), on a port of its own.
    # The learner's own settings folder (JUPYTERLAB_SETTINGS_DIR) is a fresh one: nothing in it answers the prompt.
    command, _ = cli.lab_command(["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                                  "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
                                  f"--ServerApp.root_dir={served}"],
                                 settings=jupyter.write_lab_settings(tmp_path / "app" / "settings"))
    log = open(tmp_path / "jupyterlab.log", "wb")
    server = subprocess.Popen(command, cwd=served, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while _get(f"{url}/api/status", token)[0] != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
            time.sleep(0.5)
        yield {"url": url, "token": token, "pid": server.pid, "log": tmp_path / "jupyterlab.log"}
    finally:
        # Stop the server (and the kernels it started, in its process group) by its process id.
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        try:
            os.killpg(server.pid, signal.SIGKILL)  # a kernel left behind in the server's process group
        except ProcessLookupError:
            pass
        log.close()


def test_lesson_1_runs_in_jupyterlab_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    mode = "GPU mode" if runtime.is_gpu() else "CPU mode"
    url, token = lab["url"], lab["token"]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "jupyterlab-01_vector_multiply.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}", timeout=120_000)

            # JupyterLab asks nothing about news: the setting's default is the course's "false", and no toast says
            # "Would you like to get notified about official Jupyter news?" once the notebook is open (below).
            status, body = _get(f"{url}/lab/api/settings/{jupyter.NOTIFICATION}", token)
            assert status == 200, body
            notification = json.loads(body)  # the server puts the overrides in the schema's defaults
            assert notification["schema"]["properties"]["fetchNews"]["default"] == "false", notification["schema"]
            assert "fetchNews" not in notification["settings"]  # nothing written into the learner's own settings

            # nbgrader's labextension is among the page's extensions, and activated: its menu is in the menu bar.
            config = json.loads(page.locator("#jupyter-config-data").text_content())
            assert "@jupyter/nbgrader" in {e["name"] for e in config.get("federated_extensions", [])}, config
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").wait_for(timeout=120_000)

            # The notebook is open and its kernel ready; run the probe cell (the first code cell).
            probe = page.locator(".jp-NotebookPanel .jp-CodeCell").first
            probe.wait_for(timeout=120_000)
            page.locator(".jp-StatusBar-Item", has_text="| Idle").first.wait_for(timeout=120_000)
            probe.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            try:
                page.wait_for_function("([cell, text]) => cell.innerText.includes(text)",
                                       arg=[probe.element_handle(), mode], timeout=120_000)
            finally:
                page.screenshot(path=str(shot), full_page=False)
            text = probe.locator(".jp-OutputArea-output").all_inner_texts()
            assert any(line.startswith(mode) for line in "\n".join(text).splitlines()), text
            assert page.get_by_text(NEWS_PROMPT).count() == 0, "JupyterLab asked about Jupyter news"
            bell = page.locator(".jp-Notification-Status")  # the notification centre lists it too, had it asked
            if bell.count():
                bell.first.click()
                page.wait_for_timeout(1000)
                assert page.get_by_text(NEWS_PROMPT).count() == 0, "JupyterLab's notifications hold the news prompt"
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

    # nbgrader's server extension answers, with the same version as the labextension.
    import nbgrader

    status, body = _get(f"{url}/nbgrader_version?version={nbgrader.__version__}", token)
    assert status == 200 and json.loads(body) == {"success": True}, body
