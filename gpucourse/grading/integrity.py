"""Integrity rules for the cells a learner writes (``integrity_findings``; checked on the text, so they cannot
be tampered with at run time). A cell may not:
    * run code built at run time or reach the interpreter's machinery: exec, eval, compile, __import__,
      globals, vars, locals, setattr, delattr, breakpoint, get_ipython, getattr with a computed or special
      name, special ``__names__`` (other than __name__, __doc__, __qualname__, __init__ and a few more),
      frame and traceback internals (f_globals, tb_frame, ...), sys.modules, sys._getframe, sys.settrace,
      displayhook and excepthook, IPython magics other than %time and %timeit, shell commands (``!cmd``);
    * import ctypes, cffi, gc, inspect, importlib, builtins, pickle, marshal, subprocess, multiprocessing,
      signal, socket, resource, llvmlite, numba's internals, IPython, or the grader (``BLOCKED_MODULES``);
    * set attributes other than on ``self`` in a method of its own class, use a module as a value, or
      assign into a module's mapping (os.environ[...]); that is how tests, timers and clocks get patched;
    * rebind a name a read-only cell defines (the helpers the tests call, the setup's imports) or a builtin
      a read-only cell uses (``protected_names``); importing the same thing again is fine. Binding is judged
      at module level, on both sides: a comprehension's variables, lambda and function parameters and names in
      a def or class body bind no global (``global x`` in a function and ``:=`` in a comprehension do);
    * use one of the course's own functions that already computes a task's answer (``answers``: the
      notebook's metadata "gpucourse": {"answers": {dotted name: task}}, read from the solution), called,
      imported, aliased or fetched with getattr: the task asks the learner to write it. A key of the form
      ``dotted(keyword)`` refuses only calls of that function that pass the keyword (by name or with **): the
      function is a tool the notebook needs, and that keyword makes it the answer.
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path



def source_text(cell) -> str:
    src = cell.get("source", "") if isinstance(cell, dict) else ""
    if isinstance(src, list):
        return "".join(s for s in src if isinstance(s, str))
    return src if isinstance(src, str) else ""



BLOCKED_MODULES = {
    "ctypes": "reaches memory and C functions directly", "_ctypes": "reaches memory and C functions directly",
    "cffi": "calls C functions directly", "gc": "reaches every object in the kernel",
    "inspect": "reaches the frames and globals of the tests", "importlib": "loads code by name",
    "imp": "loads code by name", "builtins": "replaces Python's builtins", "runpy": "runs code by name",
    "code": "runs code built at run time", "codeop": "compiles code at run time",
    "pickle": "can call any function while loading", "_pickle": "can call any function while loading",
    "marshal": "builds code objects", "dill": "can call any function while loading",
    "cloudpickle": "can call any function while loading", "subprocess": "starts processes",
    "multiprocessing": "starts processes", "pty": "starts processes", "signal": "changes signal handling",
    "socket": "opens network connections", "resource": "changes the kernel's resource limits",
    "llvmlite": "compiles machine code", "numba.core": "reaches numba's compiler internals",
    "numba.extending": "adds machine-level intrinsics", "IPython": "drives the notebook kernel",
    "ipykernel": "drives the notebook kernel", "jupyter_client": "drives notebook kernels",
    "zmq": "talks to notebook kernels", "sys.monitoring": "traces the tests", "trace": "traces the tests",
    "pdb": "traces the tests", "bdb": "traces the tests", "gpucourse.grading": "is the grader itself",
    "triton.runtime.build": "compiles and loads C code", "triton.backends": "reaches Triton's compiler internals",
}
# Of BLOCKED_MODULES, those refused also when reached as an attribute of an imported package (triton.backends...).
_BLOCKED_AS_ATTRIBUTE = ("triton.runtime.build", "triton.backends")
_DYNAMIC_NAMES = {
    "exec": "runs code built at run time", "eval": "runs code built at run time",
    "compile": "compiles code at run time", "__import__": "loads code by name",
    "globals": "reaches the notebook's global names", "vars": "reaches an object's or the notebook's names",
    "locals": "reaches the notebook's names", "setattr": "sets attributes by name",
    "delattr": "deletes attributes by name", "breakpoint": "starts a debugger",
    "get_ipython": "drives the notebook kernel itself",
}
# Attribute names that lead to frames, the import system, tracing or process control.
_BLOCKED_ATTRS = {
    "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next", "gi_frame",
    "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "_getframe", "settrace",
    "setprofile", "_current_frames", "displayhook", "excepthook", "meta_path", "path_hooks",
    "path_importer_cache", "addaudithook", "system", "popen", "fork", "forkpty", "kill", "killpg",
    "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle",
    "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
    "setrlimit", "prlimit", "__builtins__", "putenv", "unsetenv",
}
_SYS_ATTRS = {"modules"}  # on sys: the modules the tests import
_ALLOWED_DUNDERS = {
    "__name__", "__doc__", "__qualname__", "__init__", "__main__", "__version__", "__cuda_array_interface__",
    "__array_interface__", "__array__", "__len__", "__getitem__", "__setitem__", "__iter__", "__next__",
    "__enter__", "__exit__", "__repr__", "__str__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__hash__", "__bool__", "__call__", "__contains__", "__add__", "__sub__", "__mul__",
    "__truediv__", "__floordiv__", "__mod__", "__pow__", "__neg__", "__abs__", "__matmul__", "__post_init__",
}
_ALLOWED_MAGICS = {"time", "timeit"}
# What a read-only cell binds by calling a course function, said as the import that gives the same object.
_EQUIVALENT_IMPORTS = {"runtime.cuda()": "numba.cuda", "runtime.cupy()": "cupy"}
_DUNDER = re.compile(r"^__\w+__$")


def _module_path(dotted: str) -> Path | None:
    """Where module ``dotted`` lies on sys.path, found on disk without importing it: its source file (a
    package's __init__.py), or the folder of a namespace package; None where there is none."""
    return _module_path_on(dotted, tuple(sys.path))


@functools.lru_cache(maxsize=4096)
def _module_path_on(dotted: str, path: tuple) -> Path | None:
    parts = dotted.split(".")
    for entry in path:
        base = Path(entry or ".").joinpath(*parts)
        for f in (base / "__init__.py", base.with_suffix(".py")):
            if f.is_file():
                return f
        if base.is_dir():
            return base
    return None


def _module_exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module on sys.path (found on disk, nothing imported)."""
    return _module_path(dotted) is not None


@functools.lru_cache(maxsize=None)
def _import_map(module: str) -> dict[str, str]:
    """What the top-level imports of ``module``'s source bind: {name: dotted name of the module or object}."""
    out: dict[str, str] = {}
    f = _module_path(module)
    try:
        tree = ast.parse(f.read_text()) if f is not None and f.is_file() else None
    except (OSError, SyntaxError, ValueError):
        tree = None
    package = module if f is not None and f.name == "__init__.py" else module.rpartition(".")[0]
    for node in tree.body if tree else ():
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .specs import f: relative to this module's package
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)] if package else []
                base = ".".join([*up, *([node.module] if node.module else [])])
            for a in node.names:
                if a.name != "*" and base:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def _canonical(dotted: str) -> str:
    """``dotted`` with every step through a module's imports followed, so that an object reached through a
    module that imported it (``benchmarks.feeding_the_gpu.S.overlap_fraction``) reads as where it is defined
    (``kernels.feeding_the_gpu.overlap_fraction``)."""
    parts = dotted.lstrip(".").split(".")
    for _ in range(16):  # imports that lead on to imports, a few levels at most
        for i in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:i])
            if _module_path(module) is None:
                continue
            target = _import_map(module).get(parts[i])
            if target and target.split(".") != parts[:i + 1]:
                parts = target.split(".") + parts[i + 1:]
                break
        else:
            break
    return ".".join(parts)


def protected_names(source_cells: list) -> tuple[set[str], dict[str, str]]:
    """The names the learner's cells may not rebind, and for those bound by an import (or an equivalent
    course call), what that import gives: importing the same thing again is allowed.

    Protected: every name a locked cell that is not a test binds at module level; every function, class
    and import a test cell binds; every builtin a locked cell uses. (Plain variables of test cells, like
    ``a`` or ``got``, are the learner's to reuse.)"""
    import builtins

    protected: set[str] = set()
    same: dict[str, str] = {}
    bound_anywhere: set[str] = set()
    loaded: set[str] = set()
    for cell in source_cells:
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        if cell.get("cell_type") != "code" or not meta.get("locked"):
            continue
        try:
            tree = ast.parse(source_text(cell))
        except SyntaxError:
            continue
        for node in tree.body:
            names: list[str] = []
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    if a.name == "*":
                        continue
                    names.append(name)
                    if isinstance(node, ast.Import):
                        same[name] = a.name if a.asname else a.name.split(".")[0]
                    else:
                        same[name] = f"{'.' * node.level}{node.module or ''}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif not meta.get("grade"):
                names += sorted(module_bindings(node))
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    equivalent = _EQUIVALENT_IMPORTS.get(ast.unparse(node.value))
                    if equivalent:
                        same[node.targets[0].id] = equivalent
            protected.update(names)
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                (loaded if isinstance(n.ctx, ast.Load) else bound_anywhere).add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound_anywhere.add(n.name)
            elif isinstance(n, ast.arg):
                bound_anywhere.add(n.arg)
    protected |= {n for n in loaded - bound_anywhere if hasattr(builtins, n) and not _DUNDER.match(n)}
    return protected, same


def transform_ipython(code: str) -> str:
    """IPython's own translation of a cell (magics and shell escapes become get_ipython() calls)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return code
    try:
        return TransformerManager().transform_cell(code)
    except Exception:  # noqa: BLE001 - IPython gives up: check the text as it is
        return code


def solution_answers(notebook: dict) -> dict[str, str]:
    """The course functions that answer a task of this (solution) notebook: {dotted name: "Task N.M"}."""
    meta = (notebook.get("metadata") or {}).get("gpucourse") or {}
    answers = meta.get("answers") or {}
    return {str(k): str(v) for k, v in answers.items()} if isinstance(answers, dict) else {}


def integrity_findings(code: str, *, protected: set[str] | frozenset = frozenset(),
                        same: dict[str, str] | None = None, answers: dict[str, str] | None = None) -> list[str]:
    """Why a cell a learner wrote may not run (empty when it may): see this module's docstring.
    Each finding reads "line N: what it does (why that is refused)"."""
    python = transform_ipython(code)
    try:
        tree = compile(python, "<cell>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return [f"line {exc.lineno or 1}: {exc.msg} (the grader checks a cell before running it, and cannot "
                "read this one)"]
    except (ValueError, RecursionError, MemoryError) as exc:
        return [f"line 1: the cell cannot be checked ({type(exc).__name__})"]
    checker = _Integrity(protected, same or {}, answers or {})
    try:
        checker.run(tree)
    except RecursionError:
        return ["line 1: the cell is nested too deeply to be checked"]
    return list(dict.fromkeys(checker.findings))


class _Integrity(ast.NodeVisitor):
    """The integrity rules as an AST walk (see ``integrity_findings``)."""

    def __init__(self, protected, same, answers=None):
        self.protected, self.same, self.answers = set(protected), dict(same), dict(answers or {})
        self.findings: list[str] = []
        self.modules: dict[str, str] = {n: m for n, m in self.same.items() if "." not in m or _module_exists(m)}
        self.imported: dict[str, str] = {}  # names this cell imports from modules: name -> dotted name
        self.parents: dict[ast.AST, ast.AST] = {}
        self.scopes: list[dict] = [{"kind": "module", "globals": set(), "self": None}]
        self.skip: set[int] = set()  # ids of get_ipython() calls that are allowed magics

    def run(self, tree):
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.visit(tree)

    def resolve(self, node) -> str | None:
        """The dotted name an expression like ``S.f`` or ``kernels.feeding_the_gpu.f`` stands for, through the modules
        and imported names the cell can see; None for anything else."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        root = self.modules.get(node.id) or self.imported.get(node.id) or self.same.get(node.id)
        return ".".join([root, *reversed(parts)]) if root else None

    def check_answer(self, node, dotted: str | None, how: str):
        """Flag the use of a course function that answers a task (self.answers)."""
        if dotted is None or not self.answers:
            return
        dotted = _canonical(dotted)
        task = self.answers.get(dotted)
        if task:
            self.flag(node, f"{how} {dotted}", f"the lesson's own answer to {task}: the task asks you to write it")
        parent = self.parents.get(node)
        # dotted(keyword): a call of it, or one that takes it as an argument (functools.partial), passes the keyword
        if isinstance(parent, ast.Call) and (parent.func is node or node in parent.args):
            for key, task in self.answers.items():
                if key.startswith(dotted + "(") and key.endswith(")"):
                    kw = key[len(dotted) + 1:-1]
                    if any(k.arg in (kw, None) for k in parent.keywords):
                        self.flag(node, f"calls {dotted} with {kw}=",
                                  f"that makes it the lesson's own answer to {task}: the task asks you to write it")

    def flag(self, node, what: str, why: str):
        self.findings.append(f"line {getattr(node, 'lineno', 1)}: {what} ({why})" if why else
                             f"line {getattr(node, 'lineno', 1)}: {what}")

    # -- scopes and bindings
    def at_module_scope(self, name: str, walrus: bool = False) -> bool:
        """Whether binding ``name`` here binds the notebook's global: at module level, or in a function that
        declares it global; a comprehension's variables are its own (PEP 572: ``:=`` in one binds in the scope
        around it); lambda and function parameters and names in a class body are not global."""
        scopes = [s for s in self.scopes if s["kind"] != "comprehension"] if walrus else self.scopes
        scope = scopes[-1]
        return scope["kind"] == "module" or (scope["kind"] == "function" and name in scope["globals"])

    def bind(self, node, name: str, imported: str | None = None):
        if not self.at_module_scope(name):
            return
        if name in self.protected and not (imported is not None and self.same.get(name) == imported):
            import builtins

            what = (f"replaces the builtin {name}" if hasattr(builtins, name) and name not in self.same
                    else f"replaces {name}")
            self.flag(node, what, "a read-only cell defines it and the tests use it")

    def visit_Import(self, node):
        for a in node.names:
            self.check_module(node, a.name)
            self.check_answer(node, a.name, "imports")
            name = a.asname or a.name.split(".")[0]
            target = a.name if a.asname else a.name.split(".")[0]
            self.bind(node, name, target)
            if self.at_module_scope(name):
                self.modules[name] = target

    def visit_ImportFrom(self, node):
        module = "." * node.level + (node.module or "")
        self.check_module(node, module)
        for a in node.names:
            if a.name == "*":
                self.flag(node, f"imports * from {module}", "it could replace names the tests use")
                continue
            self.check_module(node, f"{module}.{a.name}")
            self.check_answer(node, f"{module}.{a.name}", "imports")
            name = a.asname or a.name
            self.bind(node, name, f"{module}.{a.name}")
            self.imported[name] = f"{module}.{a.name}"
            if self.at_module_scope(name) and _module_exists(f"{module}.{a.name}"):
                self.modules[name] = f"{module}.{a.name}"

    def check_module(self, node, dotted: str):
        for blocked, why in BLOCKED_MODULES.items():
            if dotted == blocked or dotted.startswith(blocked + "."):
                self.flag(node, f"imports {dotted}", f"{why}; graded notebooks may not")
                return

    def visit_FunctionDef(self, node):
        self.bind(node, node.name)
        for d in node.decorator_list:
            self.visit(d)
        self.visit(node.args)
        if node.returns:
            self.visit(node.returns)
        in_class = self.scopes[-1]["kind"] == "class"
        args = node.args.posonlyargs + node.args.args
        first = args[0].arg if in_class and args else None
        self.scopes.append({"kind": "function", "globals": set(), "self": first})
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.visit(node.args)
        self.scopes.append({"kind": "lambda", "globals": set(), "self": None})
        self.visit(node.body)
        self.scopes.pop()

    def visit_ClassDef(self, node):
        self.bind(node, node.name)
        for n in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(n)
        self.scopes.append({"kind": "class", "globals": set(), "self": None})
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    def visit_comprehension(self, node):
        """A comprehension: its first iterable is evaluated around it, the rest in its own scope."""
        first, *_ = node.generators
        self.visit(first.iter)
        self.scopes.append({"kind": "comprehension", "globals": set(), "self": self.scopes[-1]["self"]})
        for i, gen in enumerate(node.generators):
            self.visit(gen.target)
            if i:
                self.visit(gen.iter)
            for cond in gen.ifs:
                self.visit(cond)
        for part in ("elt", "key", "value"):
            if getattr(node, part, None) is not None:
                self.visit(getattr(node, part))
        self.scopes.pop()

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_comprehension

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        if isinstance(node.target, ast.Name) and self.at_module_scope(node.target.id, walrus=True):
            scopes = self.scopes
            self.scopes = [s for s in scopes if s["kind"] != "comprehension"]  # bind as where := binds
            try:
                self.bind(node.target, node.target.id)
            finally:
                self.scopes = scopes

    def visit_Global(self, node):
        self.scopes[-1]["globals"].update(node.names)

    def visit_ExceptHandler(self, node):
        if node.name:
            self.bind(node, node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node):
        if node.name:
            self.bind(node, node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node):
        if node.name:
            self.bind(node, node.name)

    def visit_MatchMapping(self, node):
        if node.rest:
            self.bind(node, node.rest)
        self.generic_visit(node)

    # -- names, attributes, assignments
    def visit_Name(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bind(node, node.id)
            return
        if node.id in self.same and node.id not in self.modules:  # a function a read-only cell imported
            self.check_answer(node, self.same[node.id], "uses")
        if node.id in _DYNAMIC_NAMES and id(node) not in self.skip:
            self.flag(node, f"uses {node.id}", f"it {_DYNAMIC_NAMES[node.id]}")
        elif _DUNDER.match(node.id) and node.id not in _ALLOWED_DUNDERS:
            self.flag(node, f"uses {node.id}", "special names reach the interpreter's machinery")
        elif node.id in ("getattr", "attrgetter", "methodcaller") and not (
                isinstance(self.parents.get(node), ast.Call) and self.parents[node].func is node):
            self.flag(node, f"passes {node.id} around", "it reaches any attribute by name")
        elif node.id in self.modules:
            parent = self.parents.get(node)
            used_plainly = (isinstance(parent, ast.Attribute) and parent.value is node) or \
                           (isinstance(parent, ast.Call) and (parent.func is node or (
                               isinstance(parent.func, ast.Name) and parent.func.id in ("getattr", "hasattr")
                               and parent.args and parent.args[0] is node)))
            if not used_plainly:
                self.flag(node, f"uses module {node.id} as a value", "a module passed around can be patched")

    def visit_Attribute(self, node):
        attr = node.attr
        if isinstance(node.ctx, ast.Load):
            dotted = self.resolve(node)
            self.check_answer(node, dotted, "uses")
            blocked = next((b for b in _BLOCKED_AS_ATTRIBUTE if dotted and (dotted == b or dotted.startswith(b + "."))),
                           None)
            if blocked and not isinstance(self.parents.get(node), ast.Attribute):
                self.flag(node, f"uses {dotted}", f"it {BLOCKED_MODULES[blocked]}; graded notebooks may not")
        if _DUNDER.match(attr) and attr not in _ALLOWED_DUNDERS:
            self.flag(node, f"uses .{attr}", "special attributes reach the interpreter's machinery")
        elif attr in _BLOCKED_ATTRS:
            self.flag(node, f"uses .{attr}", "it reaches frames, tracing, the import system or processes")
        elif attr in _SYS_ATTRS and isinstance(node.value, ast.Name) and self.modules.get(node.value.id) == "sys":
            self.flag(node, f"uses sys.{attr}", "it changes what the tests import or see")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root_name(node)
            if root is None or root != self.scopes[-1]["self"]:
                self.flag(node, f"sets attribute {_short_source(node)}",
                          "a notebook may set attributes only on self in its own classes; setting them on "
                          "modules or shared objects patches what the tests use")
        self.visit(node.value)

    def visit_Subscript(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root_name(node)
            if root is not None and (root in self.modules or root in self.protected) and \
                    not (isinstance(node.value, ast.Name) and node.value.id not in self.modules):
                self.flag(node, f"assigns into {_short_source(node.value)}",
                          "it changes a module's state, which the tests share")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and id(node) not in self.skip and \
                ((_DUNDER.match(node.value) and node.value not in _ALLOWED_DUNDERS) or node.value in _BLOCKED_ATTRS):
            self.flag(node, f"names {node.value!r}", "special names reach the interpreter's machinery")

    def visit_Call(self, node):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        # IPython magics and shell escapes, as IPython's transformer writes them.
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) and \
                isinstance(func.value.func, ast.Name) and func.value.func.id == "get_ipython":
            self.magic(node, func.attr)
            return
        if name == "getattr" and len(node.args) >= 2:
            key = node.args[1]
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                self.flag(node, "uses getattr with a computed name", "it reaches any attribute")
            else:
                base = self.resolve(node.args[0])
                self.check_answer(node, f"{base}.{key.value}" if base else None, "uses")
        if name in ("attrgetter", "methodcaller") and not all(
                isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:1]):
            self.flag(node, f"uses {name} with a computed name", "it reaches any attribute")
        self.generic_visit(node)

    def magic(self, node, method: str):
        args = node.args
        magic = args[0].value if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) else None
        if method in ("run_line_magic", "run_cell_magic") and magic in _ALLOWED_MAGICS:
            self.skip.add(id(node.func.value.func))
            for arg in args[1:]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    self.skip.add(id(arg))
                    for finding in integrity_findings(arg.value, protected=self.protected, same=self.same,
                                                       answers=self.answers):
                        self.findings.append(f"in %{magic}, {finding}")
                else:
                    self.visit(arg)
            return
        if method in ("system", "getoutput"):
            self.flag(node, "runs a shell command", "graded notebooks may not start processes")
        else:
            shown = f"%{magic}" if magic else f"get_ipython().{method}"
            self.flag(node, f"uses {shown}", "graded notebooks may use only the %time and %timeit magics")
        self.skip.add(id(node.func.value.func))
        for arg in args[1:]:
            self.visit(arg)


class _Bindings(_Integrity):
    """The names a cell binds at module level by assignment (``module_bindings``)."""

    def __init__(self):
        super().__init__(set(), {}, {})
        self.bound: set[str] = set()

    def bind(self, node, name: str, imported: str | None = None):
        if isinstance(node, ast.Name) and self.at_module_scope(name):
            self.bound.add(name)

    def flag(self, node, what: str, why: str):
        pass


def module_bindings(node) -> set[str]:
    """The names ``node`` (a statement or a module) binds at module level by assignment, for, with, del or
    ``:=``: not a comprehension's variables, lambda or function parameters, nor names inside a function or
    class body (unless the function declares them global)."""
    binder = _Bindings()
    binder.run(node if isinstance(node, ast.Module) else ast.Module(body=[node], type_ignores=[]))
    return binder.bound


def _root_name(node) -> str | None:
    """The name an attribute or subscript chain starts from (``a`` in ``a.b[0].c``), if it starts from one."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _short_source(node) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."
