"""How the course starts Jupyter: kernels with nothing on their console a learner need act on, and a JupyterLab that
opens without asking about news.

Kernels. ipykernel 7 warns "Kernel is running over TCP without encryption" on every kernel that talks over TCP
without CurveZMQ keys. The kernels the course starts itself (``python -m gpucourse run`` and ``matrix``,
``notebooks.execute``, the grader's) talk to one client on the same machine, so ``CourseKernelManager`` gives them
IPC transport (Unix sockets) in a private folder with a short path (a socket's path may not pass about 100
characters), removed with the kernel; where the platform has no IPC, TCP with CurveZMQ keys the manager makes,
where jupyter_client offers that. JupyterLab's own kernels (``lab_arguments``) get the CurveZMQ keys.

JupyterLab. A JupyterLab 4 that has never been told otherwise opens with a prompt, "Would you like to get notified
about official Jupyter news?". ``write_lab_settings`` writes an application settings folder whose
``overrides.json`` (JupyterLab's documented way to change a setting's default) sets
``@jupyterlab/apputils-extension:notification`` to ``fetchNews: "false"``; ``python -m gpucourse lab`` and the
classroom hub's user servers start JupyterLab on it (``lab_arguments``). Nothing is written into the learner's own
settings: a learner who wants the news turns it on in Settings, which wins over a default. The overrides and page
config already in the environment's application settings folder are carried over, under the course's.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

# JupyterLab setting defaults the course changes (application settings overrides)
NOTIFICATION = "@jupyterlab/apputils-extension:notification"
LAB_OVERRIDES = {NOTIFICATION: {"fetchNews": "false", "checkForUpdates": False}}
_SOCKET_PATH_ROOM = 60  # characters left for the folder of a kernel's sockets (a Unix socket path: at most 107)


def _ipc_folder() -> str | None:
    """A new private folder, with a short path, for one kernel's connection file and sockets; None where this
    platform or its ZeroMQ has no IPC transport."""
    import zmq

    if os.name != "posix" or not zmq.has("ipc"):
        return None
    base = tempfile.gettempdir()
    if len(base) > _SOCKET_PATH_ROOM:
        base = "/tmp" if os.access("/tmp", os.W_OK) else None
        if base is None:
            return None
    return tempfile.mkdtemp(prefix="gpucourse-kernel-", dir=base)


class CourseKernelManager(AsyncKernelManager):
    """An AsyncKernelManager (what nbclient uses) whose kernel talks over IPC in a private folder (``_ipc_folder``),
    removed when the kernel's resources are cleaned up; where there is no IPC, over TCP with CurveZMQ keys when the
    kernelspec supports them. Give it to nbclient as ``kernel_manager_class``: the client then owns it and shuts
    the kernel down."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._private = None
        if "transport" in kwargs or "connection_file" in kwargs:
            return
        folder = _ipc_folder()
        if folder is not None:
            self._private = folder
            self.transport = "ipc"
            self.connection_file = os.path.join(folder, "kernel.json")
            self.ip = os.path.join(folder, "kernel-ipc")  # the sockets: kernel-ipc-1 ... kernel-ipc-5
            weakref.finalize(self, shutil.rmtree, folder, True)  # should the kernel never start or stop
        elif self.has_trait("transport_encryption"):
            import zmq

            if zmq.has("curve"):
                self.transport_encryption = "auto"

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    cleanup_resources = _async_cleanup_resources


# ----------------------------------------------------------------------------------------------- JupyterLab

def default_app_settings_dir() -> Path | None:
    """JupyterLab's application settings folder in this environment (``<app dir>/settings``), or None where
    JupyterLab is not installed."""
    try:
        from jupyterlab.commands import get_app_dir
    except ImportError:
        return None
    return Path(get_app_dir()) / "settings"


def _merge(into: dict, more: dict) -> dict:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def write_lab_settings(folder: Path, base: Path | None = None) -> Path:
    """An application settings folder for JupyterLab at ``folder``: ``base``'s (default: this environment's,
    ``default_app_settings_dir``) page config and overrides, with ``LAB_OVERRIDES`` on top. Returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = default_app_settings_dir() if base is None else Path(base)
    overrides: dict = {}
    if base is not None and base.is_dir():
        for name in ("page_config.json", "page_config.json5"):
            if (base / name).is_file():
                shutil.copyfile(base / name, folder / name)
        if (base / "overrides.d").is_dir():
            shutil.copytree(base / "overrides.d", folder / "overrides.d", dirs_exist_ok=True)
        for name in ("overrides.json", "overrides.json5"):  # the order JupyterLab merges them in
            if (base / name).is_file():
                try:
                    if name.endswith(".json5"):
                        import json5

                        _merge(overrides, json5.loads((base / name).read_text(encoding="utf-8")))
                    else:
                        _merge(overrides, json.loads((base / name).read_text(encoding="utf-8")))
                except (ValueError, ImportError):
                    pass  # JupyterLab itself would report a damaged file; the course's overrides still apply
        static = base.parent / "static"  # JupyterLab reads extension metadata beside the settings folder
        if static.is_dir() and not (folder.parent / "static").exists():
            try:
                os.symlink(static, folder.parent / "static")
            except OSError:
                pass
    _merge(overrides, json.loads(json.dumps(LAB_OVERRIDES)))
    (folder / "overrides.json").write_text(json.dumps(overrides, indent=1) + "\n", encoding="utf-8")
    return folder


def _server_has_transport_encryption() -> bool:
    try:
        from jupyter_server.services.kernels.kernelmanager import MappingKernelManager
    except ImportError:
        return False
    import zmq

    return "transport_encryption" in MappingKernelManager.class_traits() and zmq.has("curve")


def lab_arguments(settings: Path) -> list[str]:
    """Options for ``jupyter lab`` (or a hub's ``jupyterhub-singleuser``): the settings folder of
    ``write_lab_settings``, and CurveZMQ keys for its kernels where jupyter_server offers them."""
    args = [f"--LabApp.app_settings_dir={settings}"]
    if _server_has_transport_encryption():
        args.append("--MappingKernelManager.transport_encryption=auto")
    return args
