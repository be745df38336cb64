"""What a notebook can reach (the guarded kernel, ``kernel_main``)
    The kernel is started from the course's kernelspec whatever the notebook's metadata names; it imports
    a copy of the course's code (gpucourse, kernels, systems, benchmarks, results), not the repository; its working
    folder holds only the submission; its environment is rebuilt from a short list (no PYTHONPATH into the
    repository, no HOME of the grader); its stdout and stderr file descriptors go to a log file, not to the
    grader. A Python audit hook (PEP 578), installed before the first cell runs, refuses:

    * reading anything outside the Python installation, the system folders and its own folders: the
      repository (solutions/, its git history), the course directory (the gradebook holds the hidden
      tests), the other students' submissions, the grader's home are all out of reach;
    * writing, deleting or renaming outside its own folders; loading a native extension written there;
    * starting processes, sending signals to other processes, opening sockets, raising resource limits;
      the one exception is Triton's compiler (``triton_tools``): its own ptxas, the C compiler it picks and
      ``ldconfig -p``, each started from Triton's own call site for it, with Triton's arguments, from an
      environment the notebook has not changed; Triton's cache (a private folder) is written by Triton only,
      and the launchers it compiles there are the only compiled modules loaded from the kernel's folders;
    * from notebook code (not from the libraries it calls): ctypes, reading the garbage collector's object
      lists, replacing a function's code, tracing, exec/eval/compile.

    That is not a security boundary, and nbgrader's FAQ says as much for any grading in the learner's own
    Python: native code escapes an audit hook (numba and llvmlite compile machine code; TensorFlow reads
    files in C++), and so does notebook code that reaches those functions through a library's callback. The
    integrity rules close the direct routes to those, and give a clear message instead of a mysterious
    failure. Where the stakes require it, grade in a container or as a user who cannot read solutions/.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from .settings import is_within


def kernel_main() -> None:
    """The graded notebook's kernel (the kernelspec's argv): private folders, resource limits, stdout and
    stderr to a log, output caps, the audit hook, then ipykernel. See this module's docstring."""
    policy = json.loads(Path(os.environ["GPUCOURSE_GRADER_POLICY"]).read_text())
    limits = policy["limits"]
    pid = os.getpid()
    kernels = Path(policy["kernels"])
    private = kernels / f"kernel-{pid}"
    for sub in ("home", "tmp", "ipython", "cache", "mpl", "triton"):
        (private / sub).mkdir(parents=True, exist_ok=True)
    (kernels / f"{pid}.pid").write_text(f"{os.getppid()}\n")
    os.environ.update({
        "HOME": str(private / "home"), "TMPDIR": str(private / "tmp"), "IPYTHONDIR": str(private / "ipython"),
        "MPLCONFIGDIR": str(private / "mpl"), "XDG_CACHE_HOME": str(private / "cache"),
        "NUMBA_CACHE_DIR": str(private / "cache/numba"), "CUPY_CACHE_DIR": str(private / "cache/cupy"),
        "GPUCOURSE_CACHE": str(private / "cache/gpucourse"), "TRITON_CACHE_DIR": str(private / "triton"),
        "PYTHONDONTWRITEBYTECODE": "1"})
    tempfile.tempdir = None
    sys.dont_write_bytecode = True
    log = os.open(private / "kernel.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails with an OSError instead
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    if policy["mode"] == "cpu":
        memory = min(limits["memory_bytes"], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cwd = os.getcwd()
    import site

    python = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, site.getusersitepackages(),
                                            *policy["allow"])]

    def hidden(entry: str) -> bool:  # inside a denied folder, and not inside Python's own folders there
        real = os.path.realpath(entry)
        deny = max((len(d) for d in policy["deny"] if is_within(real, d)), default=-1)
        return deny > max((len(a) for a in python if is_within(real, a)), default=-1)

    sys.path[:] = [p for p in sys.path if p and not hidden(p)]

    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance()
    app.initialize(sys.argv[1:])
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    _cap_kernel_output(limits["kernel_output_chars"])
    import ctypes

    trusted = {sys.prefix, sys.base_prefix, sys.exec_prefix, *policy["allow"],
               *(p for p in sys.path if p and os.path.isdir(p))}
    trusted |= {os.path.realpath(p) for p in trusted}
    allow = trusted | {"/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/opt", "/sys", "/dev", "/run",
                       "/proc", "/var/lib/nvidia", os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                       os.environ.get("CUDA_PATH", "/usr/local/cuda")}
    secrets = ["/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/sudoers", "/etc/sudoers.d", "/home", "/root"]
    _install_audit_hook(allow=sorted(allow - {""}), deny=[*policy["deny"], *secrets], writable=[cwd, str(private)],
                        trusted=sorted(p.rstrip("/") + "/" for p in trusted if p),
                        ctypes_dir=os.path.dirname(ctypes.__file__) + "/", triton=triton_tools(str(private / "tmp"), str(private / "triton")))
    app.start()


def _cap_kernel_output(limit: int) -> None:
    """Drop what a cell writes to stdout or stderr past ``limit`` characters (per cell and stream), with one
    line saying so on the same stream, before it ever leaves the kernel."""
    from IPython.core.interactiveshell import InteractiveShell
    from ipykernel.iostream import OutStream

    original = OutStream.write
    used: dict = {}

    def write(self, string):
        shell = InteractiveShell._instance
        key = (getattr(self, "name", "?"), getattr(shell, "execution_count", None))
        if key not in used:
            if len(used) > 8:
                used.clear()
            used[key] = 0
        before = used[key]
        if not isinstance(string, str) or before > limit:
            return original(self, string) if not isinstance(string, str) else len(string)
        used[key] = before + len(string)
        if used[key] <= limit:
            return original(self, string)
        original(self, string[: limit - before])
        original(self, f"\n[... the rest was dropped: a graded cell may write at most {limit} characters to "
                       f"{key[0]}]\n")
        used[key] = limit + 1
        return len(string)

    OutStream.write = write


# The environment variables that change what a started compiler runs, reads or writes: a process Triton starts
# must see them as they were when the kernel started.
TOOL_ENVIRONMENT = ("PATH", "CC", "TMPDIR", "COMPILER_PATH", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH",
                    "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "DEPENDENCIES_OUTPUT", "SUNPRO_DEPENDENCIES")
TOOL_ENVIRONMENT_PREFIXES = ("LD_", "GCC_")
# Triton's call sites (files of the triton package) that start each tool, and a file that must be on the
# way to it (the caller that decides what is compiled): a notebook calling the call site itself gets nothing.
TRITON_CALL_SITES = {
    "ptxas": (("backends/nvidia/compiler.py", "knobs.py"), ("backends/nvidia/compiler.py", "knobs.py")),
    "cc": (("runtime/build.py",), ("backends/nvidia/driver.py",)),
    "ldconfig": (("backends/nvidia/driver.py",), ("backends/nvidia/driver.py",)),
}
CC_FLAGS = frozenset({"-O3", "-shared", "-fPIC", "-Wno-psabi", "-std=c++17"})


def tool_environment(environ) -> dict:
    """The variables of ``environ`` that change what a started compiler does (TOOL_ENVIRONMENT)."""
    return {k: v for k, v in environ.items() if k in TOOL_ENVIRONMENT or k.startswith(TOOL_ENVIRONMENT_PREFIXES)}


def triton_tools(tmp: str, cache: str) -> dict | None:
    """What Triton's compiler may start in the guarded kernel, found without importing Triton: {"package": its
    folder, "tools": {resolved executable: "ptxas" | "cc" | "ldconfig"}, "tmp": the folder its compiler works
    in, "cache": its cache folder}; None where Triton is not installed. The tools are the package's own ptxas
    (``backends/nvidia/bin``), the C compiler Triton picks for its launchers (``$CC``, else gcc, else clang,
    as ``triton.runtime.build`` picks it) and ``/sbin/ldconfig`` (Triton asks it where libcuda is)."""
    import importlib.util
    import shutil

    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package = os.path.realpath(list(spec.submodule_search_locations)[0])
    tools = {}
    bin_dir = os.path.join(package, "backends", "nvidia", "bin")
    for name in ("ptxas", "ptxas-blackwell"):
        if os.path.isfile(os.path.join(bin_dir, name)):
            tools[os.path.realpath(os.path.join(bin_dir, name))] = "ptxas"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    cc = cc if cc is None or os.path.isabs(cc) else shutil.which(cc)
    if cc and os.path.isfile(cc):
        tools.setdefault(os.path.realpath(cc), "cc")
    if os.path.isfile("/sbin/ldconfig"):
        tools.setdefault(os.path.realpath("/sbin/ldconfig"), "ldconfig")
    return {"package": package + "/", "tools": tools, "tmp": os.path.realpath(tmp), "cache": os.path.realpath(cache)}


def _install_audit_hook(*, allow: list[str], deny: list[str], writable: list[str], trusted: list[str],
                        ctypes_dir: str, triton: dict | None = None) -> None:
    """The kernel's audit hook (PEP 578; see this module's docstring). Everything it uses is bound here, as C
    functions or immutable values: nothing a notebook can reach by name changes what it decides."""
    import posix

    lstat, readlink, getcwd, getpid, getframe = posix.lstat, posix.readlink, posix.getcwd, posix.getpid, sys._getframe
    rules = tuple(sorted({(r.rstrip("/") or "/", kind) for kind, roots in (("allow", allow), ("deny", deny),
                                                                            ("write", writable)) for r in roots},
                         key=lambda rule: (-len(rule[0]), rule[1] != "deny")))
    writable_roots = tuple(r.rstrip("/") for r in writable)
    trusted_roots = tuple(trusted)
    own = str(getpid())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    S_IFMT, S_IFLNK = 0o170000, 0o120000
    path_types = (str, bytes)
    decode = bytes.decode
    here = getframe(0).f_code.co_filename
    stdlib = os.path.dirname(os.__file__) + "/"
    environ = os.environ
    triton = triton or {}
    triton_root = triton.get("package") or "\0"
    triton_cache = triton.get("cache") or "\0"
    triton_tmp = triton.get("tmp") or "\0"
    triton_tools_found = dict(triton.get("tools") or {})
    call_sites = {k: (tuple(a), tuple(b)) for k, (a, b) in TRITON_CALL_SITES.items()}
    cc_flags = CC_FLAGS
    started_with = tuple(sorted(tool_environment(os.environ).items()))
    tool_env = tool_environment

    def resolve(path) -> str:
        if isinstance(path, bytes):
            path = decode(path, "utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        pending = [p for p in path.split("/") if p and p != "."][::-1]
        done, hops = "", 0
        while pending:
            part = pending.pop()
            if part == "..":
                done = done.rsplit("/", 1)[0]
                continue
            candidate = done + "/" + part
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                done = candidate
                continue
            if mode & S_IFMT == S_IFLNK and hops < 40:
                hops += 1
                target = readlink(candidate)
                if target.startswith("/"):
                    done = ""
                pending.extend([p for p in target.split("/") if p and p != "."][::-1])
                continue
            done = candidate
        return done or "/"

    def within(path, root):
        return root == "/" or path == root or path.startswith(root + "/")

    def as_path(value):
        if type(value) in path_types:
            return value
        if isinstance(value, os.PathLike) and type(value).__module__ == "pathlib":
            return str(value)
        return None

    def check_read(value) -> None:
        path = as_path(value)
        if path is None:
            if value is None or type(value) is int:
                return
            raise PermissionError("the grader accepts only plain paths (str, bytes, pathlib) in a graded notebook")
        real = resolve(path)
        if real.startswith("/proc/"):  # other processes' status only (psutil reads it), nobody's memory
            parts = real.split("/")
            if (parts[2].isdigit() and parts[2] != own and parts[3:] not in (["stat"], ["status"], [])) or \
                    parts[-1] == "mem":
                raise PermissionError(f"the grader does not let a notebook read {real}")
        for root, kind in rules:
            if within(real, root):
                if kind == "deny":
                    break
                return
        raise PermissionError(f"the grader does not let a notebook read {real} (it may read its own folder, "
                              "Python and the system's files)")

    def library_code(name: str) -> bool:  # this hook, or the standard library (not its site-packages)
        return name == here or name.startswith("<frozen ") or (name.startswith(stdlib) and
                                                              "-packages/" not in name[len(stdlib):])

    def caller():  # the first frame outside this hook and the standard library
        frame = getframe(1)
        while frame is not None and library_code(frame.f_code.co_filename):
            frame = frame.f_back
        return frame

    def triton_chain() -> list:  # the triton package's files on the way to the caller, innermost first
        frame, chain = caller(), []
        while frame is not None and frame.f_code.co_filename.startswith(triton_root):
            chain.append(frame.f_code.co_filename[len(triton_root):])
            frame = frame.f_back
        return chain

    def in_tmp(arg: str) -> bool:
        return within(resolve(arg), triton_tmp)

    def triton_may_start(event, args) -> bool:
        """Whether Triton's compiler starts one of its tools (see this module's docstring)."""
        if event == "subprocess.Popen" and len(args) == 4:
            program, argv, cwd, env = args
        elif event == "os.posix_spawn" and len(args) == 3:
            (program, argv, env), cwd = args, None
        else:
            return False
        if type(program) is not str or cwd is not None or type(argv) not in (list, tuple) or \
                not all(type(a) is str for a in argv) or not argv:
            return False
        tool = triton_tools_found.get(resolve(program))
        if tool is None:
            return False
        if tuple(sorted(tool_env(environ).items())) != started_with or \
                (env is not None and tuple(sorted(tool_env(env).items())) != started_with):
            return False
        chain = triton_chain()
        sites, via = call_sites[tool]
        if not chain or chain[0] not in sites or not any(f in via for f in chain):
            return False
        rest = list(argv[1:])
        if tool == "ldconfig":
            return rest == ["-p"]
        if tool == "ptxas":
            return all("/" not in a or in_tmp(a.split("=", 1)[-1] if a.startswith("-") else a) for a in rest)
        # the C compiler: [cc, source, flags..., -o, output in the compiler's folder, -I/-L/-l...]
        if not rest or not (in_tmp(rest[0]) or within(resolve(rest[0]), triton_root.rstrip("/"))) or \
                not rest[0].endswith((".c", ".cpp")):
            return False
        i = 1
        while i < len(rest):
            a = rest[i]
            if a == "-o":
                if i + 1 >= len(rest) or not in_tmp(rest[i + 1]):
                    return False
                i += 2
                continue
            if not (a in cc_flags or a.startswith(("-I", "-L", "-l"))):
                return False
            i += 1
        return "-o" in rest

    def check_write(value) -> None:
        path = as_path(value)
        if path is None:
            if type(value) is int:
                return
            raise PermissionError("the grader accepts only plain paths (str, bytes, pathlib) in a graded notebook")
        real = resolve(path)
        if within(real, triton_cache):
            frame = caller()
            if frame is None or not frame.f_code.co_filename.startswith(triton_root):
                raise PermissionError(f"the grader lets only Triton write in its cache, {triton_cache}")
            return
        if real == "/dev/null" or any(within(real, root) for root in writable_roots):
            return
        raise PermissionError(f"the grader lets a notebook write only in its own folder, not {real}")

    def from_notebook(skip_ctypes: bool = False) -> bool:
        frame = getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if skip_ctypes and name.startswith(ctypes_dir):
                frame = frame.f_back
                continue
            return not (name.startswith("<frozen ") or name.startswith(trusted_roots))
        return False

    processes = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                 "pty.spawn", "os.startfile"}
    network = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    writes_one = {"os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.utime",
                  "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "shutil.rmtree", "os.mkfifo",
                  "os.mknod", "tempfile.mkstemp", "tempfile.mkdtemp"}
    reads_one = {"os.listdir", "os.scandir", "os.listxattr", "os.getxattr", "os.chdir"}
    ctypes_events = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer",
                     "ctypes.string_at", "ctypes.wstring_at", "ctypes.call_function"}
    introspection = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "exec", "compile", "code.__new__",
                     "marshal.loads", "marshal.load", "function.__new__"}
    always = {"sys.settrace", "sys.setprofile", "resource.setrlimit", "resource.prlimit", "sys.unraisablehook"}
    watched = frozenset({"open", "os.rename", "os.symlink", "os.link", "os.kill", "os.killpg", "sqlite3.connect",
                         "import", "object.__setattr__", *processes, *network, *writes_one, *reads_one,
                         *ctypes_events, *introspection, *always})

    def hook(event, args):
        if event not in watched:
            return
        if event == "open":
            path, mode, flags = args
            if (type(mode) is str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or \
                    (type(flags) is int and flags & write_flags):
                check_write(path)
            else:
                check_read(path)
        elif event in reads_one:
            check_read(args[0] if args else None)
        elif event in writes_one:
            check_write(args[0])
        elif event == "os.rename":
            check_write(args[0])
            check_write(args[1])
        elif event == "os.symlink":
            check_write(args[1])
        elif event == "os.link":
            check_write(args[0])
            check_write(args[1])
        elif event == "sqlite3.connect":
            database = args[0]
            if database not in (":memory:", "", b":memory:", b""):
                if type(database) in path_types and (database[:5] in ("file:", b"file:")):
                    raise PermissionError("the grader does not let a notebook open databases by URI")
                check_write(database)
        elif event == "import":
            filename = args[1] if len(args) > 1 else None
            if type(filename) is str and any(within(resolve(filename), r) for r in writable_roots):
                frame = caller()
                if within(resolve(filename), triton_cache) and frame is not None and \
                        frame.f_code.co_filename == triton_root + "runtime/build.py":
                    return  # a launcher Triton compiled and cached (only Triton writes there)
                raise PermissionError("the grader does not let a notebook load a compiled module it wrote")
        elif event == "object.__setattr__":
            if len(args) > 1 and args[1] in ("__code__", "__defaults__", "__kwdefaults__", "__globals__") and \
                    from_notebook():
                raise PermissionError(f"the grader does not let a notebook replace a function's {args[1]}")
        elif event in processes:
            if triton_may_start(event, args):
                return
            raise PermissionError("the grader does not let a notebook start processes")
        elif event in ("os.kill", "os.killpg"):
            if event == "os.killpg" or str(args[0]) != own:
                raise PermissionError("the grader does not let a notebook signal other processes")
        elif event in network:
            raise PermissionError("the grader does not let a notebook use the network")
        elif event in ctypes_events:
            if from_notebook(skip_ctypes=True):
                raise PermissionError("the grader does not let a notebook use ctypes")
        elif event in introspection:
            if from_notebook():
                raise PermissionError(f"the grader does not let a notebook use {event}")
        elif event in always:
            raise PermissionError(f"the grader does not let a notebook use {event}")

    sys.addaudithook(hook)
