"""``syncless trace [--fn module:qualname]... script.py [args...]``.

Runs a script as ``__main__`` with the named functions checked in
``record`` mode, then prints the table of sync sites found (count, site,
operation, which layers saw it, one stack each; with ``--backend cupti``
also the host time blocked per site: total, mean, max). When nothing can
be checked here (a CPU-only torch build), the report says so and why,
instead of an empty table. A function of the script itself is named with
the script's stem or ``__main__`` as its module (``--fn __main__:step``); it
gets the checked decorator in the script's source, so it is checked however
it is called. A function of an importable module is replaced on its module
or class for the run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import traceback
import types
from pathlib import Path

from syncless import syncs
from syncless._core.errors import MissingDependencyError
from syncless.syncs import _backend

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
    # Both optional for argparse, so that a missing script is reported in words by run(), not as
    # "the following arguments are required: script, script_args".
    parser.add_argument("script", nargs="?", default=None, help="the Python script to run (required)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed to the script (default: none)")
    parser.usage = "%(prog)s [-h] [--debug] [--fn MODULE:QUALNAME]... [--backend {auto,torch,cupti}] script [ARGS...]"


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


def _patch_module_function(module_name: str, qualname: str) -> tuple[object, str, object]:
    module = importlib.import_module(module_name)
    *owners, name = qualname.split(".")
    owner: object = module
    for part in owners:
        owner = getattr(owner, part)
    raw = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
    if isinstance(raw, staticmethod):
        replacement: object = staticmethod(syncs.checked(raw.__func__))
    elif isinstance(raw, classmethod):
        replacement = classmethod(syncs.checked(raw.__func__))
    elif callable(raw):
        replacement = syncs.checked(raw)
    else:
        raise TypeError(f"it is a {type(raw).__name__}, not a function")
    setattr(owner, name, replacement)
    return owner, name, raw


def _run_as_main(code: types.CodeType, path: Path, argv: list[str]) -> int:
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    main.__builtins__ = __builtins__
    setattr(main, _DECORATOR_NAME, syncs.checked)
    saved_main, saved_argv = sys.modules.get("__main__"), sys.argv
    sys.modules["__main__"] = main
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        exec(code, main.__dict__)
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == str(path.parent.resolve()):
            del sys.path[0]
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def run(args: argparse.Namespace) -> int:
    """Run the script with the functions checked; print the sync sites; return its exit code."""
    if args.script is None:
        print("syncless trace: error: no script given; name the Python script to run, e.g. "
              "`syncless trace --fn mypkg.engine:Engine.step script.py ARGS...`", file=sys.stderr)
        return 2
    path = Path(args.script)
    if not path.is_file():
        print(f"syncless trace: error: no such script: {path}", file=sys.stderr)
        return 2
    try:
        targets = [parse_target(text) for text in args.fn]
    except ValueError as err:
        print(f"syncless trace: error: {err}", file=sys.stderr)
        return 2
    script_names = {"__main__", path.stem}
    previous_mode = syncs.mode()
    was_enabled = syncs.is_enabled()
    previous_backend = _backend.backend.requested
    if getattr(args, 'backend', None) is not None:
        if was_enabled:
            syncs.disable()
        syncs.set_backend(getattr(args, 'backend', None))
    syncs.set_mode("record")
    syncs.reset()
    restore: list[tuple[object, str, object]] = []
    try:
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            code = _compile_script(path, {q for m, q in targets if m in script_names})
            for module_name, qualname in targets:
                if module_name not in script_names:
                    try:
                        restore.append(_patch_module_function(module_name, qualname))
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
        status = _run_as_main(code, path, list(args.script_args))
        checked = ", ".join(args.fn) if args.fn else "regions marked in the code"
        print(f"syncless trace: {path} (checked: {checked})")
        print(syncs.report().format())
        return status
    finally:
        for owner, name, raw in reversed(restore):
            setattr(owner, name, raw)
        syncs.reset()
        if not was_enabled or getattr(args, 'backend', None) is not None:
            syncs.disable()
        if getattr(args, 'backend', None) is not None:
            syncs.set_backend(previous_backend)
            if was_enabled:
                syncs.enable()
        syncs.set_mode(previous_mode)
