"""Logging helpers. The library never configures handlers."""

from __future__ import annotations

import logging
import threading

_seen_keys: set[tuple[str, str]] = set()
_seen_lock = threading.Lock()


def log_once(logger: logging.Logger, level: int, key: str, message: str, *args: object) -> bool:
    """Log ``message`` at ``level`` the first time ``key`` is seen for ``logger``.

    Returns:
        True if the message was emitted now, False if it had been before.
    """
    with _seen_lock:
        marker = (logger.name, key)
        if marker in _seen_keys:
            return False
        _seen_keys.add(marker)
    logger.log(level, message, *args)
    return True


def forget_logged(prefix: str = "") -> None:
    """Let keys starting with ``prefix`` be logged again (for tests)."""
    with _seen_lock:
        for marker in [m for m in _seen_keys if m[1].startswith(prefix)]:
            _seen_keys.discard(marker)
