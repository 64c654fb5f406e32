"""How a ``syncless`` command ends: its exit statuses and the errors that choose them.

Here, not in ``syncless.cli``, so that the modules that implement the
subcommands (``syncs._trace``, ``doctor``, ``demo``, ``bench``) raise them
without importing the command line. ``syncless.cli`` turns them into the
one line on stderr and the status.
"""

from __future__ import annotations

from syncless._core.errors import SynclessError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class UsageError(SynclessError, ValueError):
    """The command line asked for something that cannot run; the message says what to change (exit status 2)."""


class Terminated(BaseException):
    """SIGTERM arrived; raised in the main thread so that every ``finally`` (stopping stage processes) runs."""
