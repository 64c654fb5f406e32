"""``syncless trace [--fn module:qualname]... [--fail-on-sync] [--timeline out.json|out.png] (script.py | -m module) [args...]``.

Runs a script (or, with ``-m``, a module, as ``python -m`` does) as
``__main__`` with the named functions checked in ``record`` mode, then
prints the table of sync sites found (count, site, operation, which layers
saw it, one stack each; with ``--backend cupti`` also the host time blocked
per site: total, mean, max). When nothing can be checked here (a CPU-only
torch build), the report says so and why, instead of an empty table. A
function of the script itself is named with the script's stem (the
module's name with ``-m``) or ``__main__`` as its module (``--fn
__main__:step``); it gets the checked decorator in the script's source, so
it is checked however it is called. A function of an importable module is
replaced on its module or class for the run, and on every loaded module
that holds the same function under a name of its own (a package that
re-exports it). A class is refused: its methods are named instead.

Exit status: the script's, as Python gives it; with ``--fail-on-sync``, 1
when the script succeeded but a sync was recorded or nothing could be
checked. Ctrl-C (or SIGTERM) prints the report gathered so far, marked as
interrupted, and exits 130 (143). ``--timeline PATH`` also records the
timeline and writes it there: Chrome trace-event JSON for ``.json``, a
picture (matplotlib) for ``.png``/``.svg``/``.pdf``. See ``docs/trace.md``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
import traceback
import types
from pathlib import Path

from syncless import syncs
from syncless._core.errors import MissingDependencyError
from syncless.syncs import _backend, _timeline

_DECORATOR_NAME = "__syncless_checked__"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``trace`` subcommand's arguments."""
    parser.add_argument(
        "--fn",
        action="append",
        default=[],
        metavar="MODULE:QUALNAME",
        help="a function to check, e.g. mypkg.engine:Engine.step or __main__:decode_step (repeatable; "
        "default: none, only the regions the code marks itself)",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "torch", "cupti"),
        default=None,
        help="which layers find syncs (default: SYNCLESS_SYNC_BACKEND, else auto); cupti also sees syncs in "
        "C/C++ extensions, cupy and the allocator, and adds the host time blocked per site (needs syncless[cupti])",
    )
    parser.add_argument(
        "--fail-on-sync",
        action="store_true",
        help="exit with status 1 when a hidden sync was recorded, or nothing could be checked, although the "
        "script succeeded; for CI (default: off, the script's own exit status)",
    )
    parser.add_argument(
        "--timeline",
        default=None,
        metavar="PATH",
        help="also write the syncs and checked regions on a timeline: Chrome trace JSON (PATH ends in .json, "
        "for Perfetto or chrome://tracing) or a picture (.png, .svg, .pdf; needs matplotlib) (default: none)",
    )
    # REMAINDER: everything after the module's name goes to it, as with `python -m module ARGS`.
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None, metavar="MODULE",
                        help="run a module as `python -m MODULE` does, instead of a script (default: none)")
    # Both optional for argparse, so that a missing script is reported in words by run(), not as
    # "the following arguments are required: script, script_args".
    parser.add_argument("script", nargs="?", default=None, help="the Python script to run (required without -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to the script (default: none)")
    parser.usage = ("%(prog)s [-h] [--debug] [--fn MODULE:QUALNAME]... [--backend {auto,torch,cupti}] "
                    "[--fail-on-sync] [--timeline PATH] {script [ARGS...] | -m MODULE [ARGS...]}")


TIMELINE_SUFFIXES = (".json", ".png", ".svg", ".pdf")


def _timeline_path(text: str | None) -> Path | None:
    """``--timeline``'s path, checked before the script runs; None without the option."""
    if text is None:
        return None
    path = Path(text)
    if path.suffix.lower() not in TIMELINE_SUFFIXES:
        raise ValueError(f"--timeline writes {', '.join(TIMELINE_SUFFIXES)} (JSON trace or a picture); got {text!r}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--timeline {text}: no such directory {path.parent}")
    return path


def _write_timeline(found, path: Path) -> None:
    """Write the trace JSON or the picture; a missing matplotlib is said, and the report stands."""
    try:
        if path.suffix.lower() == ".json":
            found.to_chrome_trace(path)
        else:
            found.plot(path)
    except MissingDependencyError as err:
        print(f"syncless trace: --timeline: {err}", file=sys.stderr)
        return
    print(f"syncless trace: timeline written to {path}")


class _TargetError(Exception):
    """A ``--fn`` target that cannot be checked; the message names the option and its value."""


def parse_target(text: str) -> tuple[str, str]:
    """Split ``module:qualname``; raise ValueError naming the expected form."""
    module, sep, qualname = text.partition(":")
    if not sep or not module or not qualname or any(not part.isidentifier() for part in qualname.split(".")):
        raise ValueError(f"--fn expects MODULE:QUALNAME such as mypkg.engine:Engine.step; got {text!r}")
    return module, qualname


class _Decorate(ast.NodeTransformer):
    """Put the checked decorator, outermost, on the script's functions named by qualname."""

    def __init__(self, qualnames: set[str]):
        self.wanted = qualnames
        self.found: set[str] = set()
        self._scope: list[str] = []

    def _visit_function(self, node):
        qualname = ".".join([*self._scope, node.name])
        if qualname in self.wanted:
            self.found.add(qualname)
            node.decorator_list.insert(0, ast.Name(id=_DECORATOR_NAME, ctx=ast.Load()))
        self._scope += [node.name, "<locals>"]
        self.generic_visit(node)
        del self._scope[-2:]
        return node

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node):
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()
        return node


def _compile_script(path: Path, qualnames: set[str]) -> types.CodeType:
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    if qualnames:
        decorate = _Decorate(qualnames)
        tree = ast.fix_missing_locations(decorate.visit(tree))
        missing = sorted(qualnames - decorate.found)
        if missing:
            raise ValueError(f"{path} defines no function {', '.join(missing)} (give the qualname, e.g. Class.method)")
    return compile(tree, str(path), "exec")


def _methods(cls: type) -> list[str]:
    """The names of the functions a class defines itself, public ones first (for the refusal of a class)."""
    names = [name for name, value in vars(cls).items()
             if isinstance(value, (staticmethod, classmethod, types.FunctionType))]
    return sorted(names, key=lambda name: (name.startswith("_"), name))


def _refuse_class(module_name: str, qualname: str, cls: type) -> None:
    methods = _methods(cls)
    shown = ", ".join(methods[:12]) + (f" and {len(methods) - 12} more" if len(methods) > 12 else "")
    example = f"; e.g. --fn {module_name}:{qualname}.{methods[0]}" if methods else ""
    # Replacing a class with a checked function breaks every subclass and isinstance() of it (json's
    # JSONEncoder gave "function() argument 'code' must be code").
    raise TypeError(f"it is a class, and a class cannot be checked as a whole: name one of its methods"
                    f"{example} (it defines: {shown or 'none'})")


def _patch_module_function(module_name: str, qualname: str) -> list[tuple[object, str, object]]:
    """Replace the function with its checked version where it is defined and wherever it is re-exported.

    Returns:
        ``(owner, name, original)`` for each attribute replaced, to put back after the run.
    """
    module = importlib.import_module(module_name)
    *owners, name = qualname.split(".")
    owner: object = module
    for part in owners:
        owner = getattr(owner, part)
    raw = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
    if isinstance(raw, type):
        _refuse_class(module_name, qualname, raw)
    if isinstance(raw, staticmethod):
        replacement: object = staticmethod(syncs.checked(raw.__func__))
    elif isinstance(raw, classmethod):
        replacement = classmethod(syncs.checked(raw.__func__))
    elif callable(raw):
        replacement = syncs.checked(raw)
    else:
        raise TypeError(f"it is a {type(raw).__name__}, not a function")
    replaced = [(owner, name, raw)]
    setattr(owner, name, replacement)
    if not owners:
        # `from .engine import step` in the package's __init__ bound the original to a second name before
        # we got here: a caller of pkg.step would run unchecked. Replace every module-level alias too.
        for other in list(sys.modules.values()):
            if other is module or not isinstance(other, types.ModuleType):
                continue
            try:
                aliases = [key for key, value in vars(other).items() if value is raw]
            except TypeError:  # a module object without a __dict__ to read
                continue
            for key in aliases:
                replaced.append((other, key, raw))
                setattr(other, key, replacement)
    return replaced


class _Interrupted(Exception):
    """The script was stopped by Ctrl-C or SIGTERM; ``status`` is the exit status that says which."""

    def __init__(self, status: int, how: str):
        super().__init__(how)
        self.status = status


def _exit_status(code: object) -> int:
    """The status Python exits with for ``SystemExit(code)``; prints a message code as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("msg"): Python prints msg to stderr and exits 1
    return 1


def _run_as_main(code: types.CodeType, target: "_Target", argv: list[str]) -> int:
    from syncless._core.exits import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated

    main = types.ModuleType("__main__")
    main.__file__ = target.file
    main.__builtins__ = __builtins__
    main.__spec__ = target.spec  # type: ignore[assignment]
    main.__package__ = target.package
    setattr(main, _DECORATOR_NAME, syncs.checked)
    saved_main, saved_argv = sys.modules.get("__main__"), sys.argv
    sys.modules["__main__"] = main
    sys.argv = [target.argv0, *argv]
    sys.path.insert(0, target.path_entry)
    try:
        exec(code, main.__dict__)
        return 0
    except SystemExit as stop:
        return _exit_status(stop.code)
    except KeyboardInterrupt as err:
        raise _Interrupted(EXIT_INTERRUPTED, "interrupted (Ctrl-C)") from err
    except Terminated as err:
        raise _Interrupted(EXIT_TERMINATED, "terminated (SIGTERM)") from err
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == target.path_entry:
            del sys.path[0]
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


class _Target:
    """What runs as ``__main__``: a script's file, or a module's (``-m``), with what Python sets for each."""

    def __init__(self, file: str, names: set[str], argv0: str, path_entry: str, spec: object = None,
                 package: str | None = None):
        self.file = file  # absolute, as Python makes __file__ of the script it runs
        self.names = names  # the module names --fn may use for its functions
        self.argv0 = argv0
        self.path_entry = path_entry  # sys.path[0]: the script's folder, or the current folder with -m
        self.spec = spec
        self.package = package
        self.shown = file


def _script_target(script: str) -> _Target:
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {path}")
    file = os.path.abspath(path)
    target = _Target(file, {"__main__", path.stem}, script, os.path.dirname(file))
    target.shown = script
    return target


def _module_target(name: str) -> _Target:
    """Find ``name`` as ``python -m`` does (a package runs its ``__main__``); nothing of it runs yet."""
    sys.path.insert(0, os.getcwd())  # python -m puts the current folder first
    try:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as err:  # a parent package that is missing, or a bad name
            raise FileNotFoundError(f"-m {name}: no module named {name!r} ({err})") from err
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{name}.__main__")
            if spec is None:
                raise FileNotFoundError(f"-m {name}: {name} is a package and has no __main__ module to run")
    finally:
        del sys.path[0]
    if spec is None:
        raise FileNotFoundError(f"-m {name}: no module named {name!r}")
    if not spec.has_location or not spec.origin or not spec.origin.endswith(".py"):
        raise FileNotFoundError(f"-m {name}: {spec.origin or name} is not Python source that trace can run")
    file = os.path.abspath(spec.origin)
    target = _Target(file, {"__main__", name, spec.name}, file, os.getcwd(), spec, spec.parent)
    target.shown = f"-m {name}"
    return target


def run(args: argparse.Namespace) -> int:
    """Run the script with the functions checked; print the sync sites; return its exit code."""
    module_argv = getattr(args, "module", None)
    if module_argv is not None and not module_argv:
        print("syncless trace: error: -m needs a module name, e.g. `syncless trace -m mypkg.serve ARGS...`",
              file=sys.stderr)
        return 2
    if args.script is None and module_argv is None:
        print("syncless trace: error: no script given; name the Python script to run, e.g. "
              "`syncless trace --fn mypkg.engine:Engine.step script.py ARGS...` (or a module: -m MODULE)",
              file=sys.stderr)
        return 2
    try:
        if module_argv is not None:
            if args.script is not None:  # `-m` came after the script: a script's argument, not ours
                raise FileNotFoundError("give a script or -m MODULE, not both")
            target, script_args = _module_target(module_argv[0]), list(module_argv[1:])
        else:
            target, script_args = _script_target(args.script), list(args.script_args)
        targets = [parse_target(text) for text in args.fn]
        timeline = _timeline_path(getattr(args, "timeline", None))
    except (FileNotFoundError, ValueError) as err:
        print(f"syncless trace: error: {err}", file=sys.stderr)
        return 2
    previous_mode = syncs.mode()
    was_enabled = syncs.is_enabled()
    previous_backend = _backend.backend.requested
    if getattr(args, 'backend', None) is not None:
        if was_enabled:
            syncs.disable()
        syncs.set_backend(getattr(args, 'backend', None))
    syncs.set_mode("record")
    syncs.reset()
    was_recording = _timeline.is_recording()
    if timeline is not None:
        syncs.record_timeline(True)
    restore: list[tuple[object, str, object]] = []
    interrupted: _Interrupted | None = None
    try:
        sys.path.insert(0, target.path_entry)
        try:
            code = _compile_script(Path(target.file), {q for m, q in targets if m in target.names})
            for module_name, qualname in targets:
                if module_name not in target.names:
                    try:
                        restore += _patch_module_function(module_name, qualname)
                    except (ImportError, AttributeError, TypeError) as err:
                        raise _TargetError(f"--fn {module_name}:{qualname}: {err}") from err
        except (_TargetError, ValueError, SyntaxError) as err:
            print(f"syncless trace: error: {err}", file=sys.stderr)
            return 2
        finally:
            del sys.path[0]
        try:
            syncs.enable()  # when it cannot, the report below says why
        except MissingDependencyError as err:
            print(f"syncless trace: error: {err}", file=sys.stderr)
            return 2
        try:
            status = _run_as_main(code, target, script_args)
        except _Interrupted as stop:
            interrupted, status = stop, stop.status
        checked = ", ".join(args.fn) if args.fn else "regions marked in the code"
        found = syncs.report()
        if interrupted is not None:
            # Ctrl-C is how a trace of a server or a long loop ends: what was gathered is the result.
            print(f"syncless trace: {interrupted}: the report covers what ran until then", file=sys.stderr)
        print(f"syncless trace: {target.shown} (checked: {checked})" + (f" [{interrupted}]" if interrupted else ""))
        print(found.format())
        if timeline is not None:
            _write_timeline(found, timeline)
        if getattr(args, "fail_on_sync", False) and status == 0 and interrupted is None:
            if found:
                print(f"syncless trace: --fail-on-sync: {found.total} hidden GPU sync(s) at {len(found.sites)} "
                      "call site(s); exit status 1", file=sys.stderr)
                return 1
            if found.not_checked is not None:
                print("syncless trace: --fail-on-sync: nothing could be checked here, so the run cannot pass; "
                      "exit status 1", file=sys.stderr)
                return 1
        return status
    finally:
        for owner, name, raw in reversed(restore):
            setattr(owner, name, raw)
        syncs.reset()
        syncs.record_timeline(was_recording)
        if not was_enabled or getattr(args, 'backend', None) is not None:
            syncs.disable()
        if getattr(args, 'backend', None) is not None:
            try:
                syncs.set_backend(previous_backend)
            except RuntimeError:
                if interrupted is None:
                    raise
                # Ctrl-C landed inside a region's own bookkeeping (enter or exit), which then never closed it. The
                # script is over and the report printed; the exit status must still say "interrupted".
            else:
                if was_enabled:
                    syncs.enable()
        syncs.set_mode(previous_mode)
