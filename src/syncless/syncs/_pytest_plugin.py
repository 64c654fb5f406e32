"""pytest plugin: ``--sync-check=warn|error|record``, the ``sync_checked`` marker, a summary.

Registered through the ``pytest11`` entry point ``syncless``. Without
``--sync-check`` it does nothing but register its marker (so
``--strict-markers`` accepts it). With it:

* the mode is set before test modules are imported (so ``@checked`` in the
  code under test decides with it), and the detector is enabled;
* the body of a test marked ``@pytest.mark.sync_checked`` is a checked
  region (fixtures' set-up and tear-down are not);
* the terminal report ends with the table of sync sites found (or, where
  the detector could not start, one line saying that nothing was checked
  and why; with ``--sync-check=error`` that also fails the run, exit status 1);
* every test starts with each ``allowed(first_only=True)`` site unspent.

Under pytest-xdist each worker checks its own tests and hands its record to
the controller when it finishes (``workeroutput``); the controller's
summary is the sum of the workers' (a worker that died without handing it
over is named). An ``async def`` test (pytest-asyncio) is checked inside
the task that runs it: the region belongs to that task, not to the thread
that started the loop.

A bad ``SYNCLESS_SYNC_CHECK`` or ``SYNCLESS_SYNC_BACKEND`` fails only a run
with ``--sync-check`` (a usage error naming the variable, the value and the
allowed values); every other run gets the one warning issued when
:mod:`syncless.syncs` is imported, and is otherwise unaffected.

Everything it changes is put back at the end of the session; per-session
state lives in ``config.stash``, not in module globals. Load it from a
source tree with ``-p no:syncless -p syncless.syncs._pytest_plugin``: the
``no:`` blocks the installed entry point, so the module is never registered
twice (pluggy refuses that).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import pytest

from syncless import syncs
from syncless.syncs import _backend, _hook, _report, _state

MARKER = "sync_checked"
_WORKER_OUTPUT_KEY = "syncless_sync_check"


@dataclass
class _Session:
    mode: str
    previous_mode: str
    was_enabled: bool
    # pytest-xdist controller: workers whose record was gathered, and workers that went down without one.
    workers_gathered: list[str] = field(default_factory=list)
    workers_lost: list[str] = field(default_factory=list)
    workers_checked: bool = False  # at least one worker's detector was active
    workers_not_checked: str | None = None  # why not, as a worker said
    failed_unchecked: bool = False  # mode error and nothing could be checked: the run fails


_SESSION = pytest.StashKey[_Session]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("syncless", "syncless hidden-sync detector")
    group.addoption(
        "--sync-check",
        dest="sync_check",
        choices=("warn", "error", "record"),
        default=None,
        help="check tests marked sync_checked (and code under @syncless.syncs.checked) for hidden GPU syncs: "
        "warn, fail the test (error), or collect a table of sync sites (record)",
    )


def _start(config: pytest.Config, wanted: str | None) -> None:
    if _SESSION in config.stash:
        return
    if wanted is None:
        return
    bad_env = syncs.env_error() or _backend.env_error()
    if bad_env is not None:
        # Only a run that asks for the detector fails; any other run got the one warning at import.
        raise pytest.UsageError(f"--sync-check={wanted}: {bad_env}; fix or unset it")
    session = _Session(wanted, syncs.mode(), syncs.is_enabled())
    config.stash[_SESSION] = session
    syncs.set_mode(wanted)
    syncs.reset()
    # Again after pytest_unconfigure: pytest may run that hook inside a catch_warnings
    # block whose exit puts our warnings hook back; cleanups run after it.
    config.add_cleanup(lambda: _put_back(session))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before the root conftest imports the code under test (options are only
    # pre-parsed here, hence known_args_namespace).
    _start(early_config, getattr(early_config.known_args_namespace, "sync_check", None))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: the test body is a checked region of the syncless hidden-sync detector (active with --sync-check)",
    )
    _start(config, config.getoption("sync_check", None))
    if _SESSION in config.stash:
        syncs.enable()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    session = item.config.stash.get(_SESSION, None)
    if session is None or item.get_closest_marker(MARKER) is None:
        return (yield)
    # enable() again here: a fixture may only now have made a device available.
    syncs.enable()
    body = getattr(item, "obj", None)
    if inspect.iscoroutinefunction(body):
        # pytest-asyncio runs the body in a task of its loop: the region must be entered there (a region
        # belongs to the thread and task that entered it), so it goes inside the coroutine.
        item.obj = _checked_coroutine(body)
        try:
            return (yield)
        finally:
            item.obj = body
    with syncs.checking():
        return (yield)


def _checked_coroutine(body):
    @functools.wraps(body)
    async def checked_body(*args, **kwargs):
        with syncs.checking():
            return await body(*args, **kwargs)

    return checked_body


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Each test starts with every allowed(first_only=True) site unspent: a site spent by an earlier test would
    # make this one's outcome depend on the order and on how pytest-xdist splits the tests.
    if _SESSION in item.config.stash:
        _state.forget_first_only_sites()


def _nothing_checked(session: _Session) -> str | None:
    """Why nothing was checked in this run (the report's words), or None if something was."""
    if session.workers_gathered or session.workers_lost:
        # pytest-xdist's controller runs no test: its workers say whether anything was checked.
        return None if session.workers_checked else (session.workers_not_checked or "no pytest-xdist worker "
                                                                                    "handed over its record")
    return syncs.report().not_checked


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    output = getattr(config, "workeroutput", None)
    state = config.stash.get(_SESSION, None)
    if state is None:
        return
    if output is None:
        # --sync-check=error is the strict form: a run in which nothing could be checked fails, as
        # `syncless trace --fail-on-sync` does, instead of passing with "NOTHING WAS CHECKED".
        if state.mode == "error" and _nothing_checked(state) is not None and session.exitstatus == pytest.ExitCode.OK:
            state.failed_unchecked = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    # A pytest-xdist worker: hand the record to the controller (plain values: execnet carries no objects).
    found = syncs.report()
    output[_WORKER_OUTPUT_KEY] = {"sites": [site.to_plain() for site in found.sites],
                                  "not_checked": found.not_checked, "backend": found.backend}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: a worker finished; add its record to this process's."""
    session = node.config.stash.get(_SESSION, None)
    if session is None:
        return
    name = getattr(getattr(node, "gateway", None), "id", None) or "worker"
    handed = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT_KEY)
    if handed is None:
        session.workers_lost.append(name)
        return
    session.workers_gathered.append(name)
    for plain in handed["sites"]:
        _report.recorder.add_site(_report.SyncSite.from_plain(plain, where=name))
    if handed["not_checked"] is None:
        session.workers_checked = True
        _report.recorder.backend = handed["backend"] or _report.recorder.backend
    elif session.workers_not_checked is None:
        session.workers_not_checked = handed["not_checked"]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is None:
        return
    terminalreporter.section(f"syncless sync check ({session.mode})")
    # Where the detector could not start, the report itself says that nothing was checked, and why.
    found = syncs.report()
    if session.workers_gathered or session.workers_lost:
        # pytest-xdist's controller runs no test: the workers' records are the report, and so is their word on
        # whether anything was checked.
        found.not_checked = _nothing_checked(session)
        terminalreporter.write_line(f"(gathered from {len(session.workers_gathered)} pytest-xdist worker(s): "
                                    f"{', '.join(session.workers_gathered) or 'none'})")
        if session.workers_lost:
            terminalreporter.write_line(f"NOT INCLUDED: worker(s) {', '.join(session.workers_lost)} went down "
                                        "without handing over their record; syncs they saw are missing")
    terminalreporter.write_line(found.format(stacks=session.mode == "record"))
    if session.failed_unchecked:
        terminalreporter.write_line("syncless: --sync-check=error FAILS THIS RUN because nothing could be checked "
                                    "(above). Without a GPU, try the plugin with --sync-check=warn or record: they "
                                    "say the same and pass.", red=True, bold=True)


def _put_back(session: _Session) -> None:
    if not session.was_enabled:
        syncs.disable()
        _hook.forget_filters()  # pytest's configure-time catch_warnings closes before this and may restore it


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is None:
        return
    del config.stash[_SESSION]
    syncs.reset()
    if not session.was_enabled:
        syncs.disable()
    syncs.set_mode(session.previous_mode)
