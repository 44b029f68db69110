"""The C++ library's log lines, through Python's logging.

From Python, the library's lines (which the ``ferry`` CLI writes to stderr) go to the logger
``ferry.<component>`` (``ferry.kv``, ``ferry.fabric``, ``ferry.moe``, ...), children of the
``ferry`` logger, at their levels (debug, info, warning, error), with the time the library
logged them. Configure them as any library's: ``logging.getLogger("ferry").setLevel(...)``,
handlers, propagation. With no logging configured, Python's last-resort handler prints
warnings and errors to stderr, as before.

The library's threads never call into Python (they may hold the library's locks, and a Python
thread may wait on those): they queue the line, and a daemon thread here hands the queue to
logging. The library's own threshold follows the ``ferry`` logger's effective level (read by
that thread at least every 0.2 s, by :func:`flush` and by each new TransferEngine), so lines
below it cost nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

LOGGER = logging.getLogger("ferry")

# The library's levels (include/ferry/common/log.h) and logging's.
_TO_PY = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}
_POLL_S = 0.2

_ext: Any = None
_lock = threading.Lock()  # one emitter at a time: lines stay in the order they were logged
_thread: Any = None
_stop = False


def sync_level() -> None:
    """Sets the library's threshold from the ``ferry`` logger's effective level."""
    level = LOGGER.getEffectiveLevel()
    if level <= logging.DEBUG:
        native = 0
    elif level <= logging.INFO:
        native = 1
    elif level <= logging.WARNING:
        native = 2
    elif level <= logging.ERROR:
        native = 3
    else:
        native = 4  # off
    _ext.log_set_level(native)


def _emit(lines: Any) -> None:
    for level, component, message, when in lines:
        lvl = _TO_PY.get(level, logging.ERROR)
        logger = LOGGER.getChild(component) if component else LOGGER
        if not logger.isEnabledFor(lvl):
            continue
        record = logger.makeRecord(logger.name, lvl, "(ferry)", 0, "%s", (message,), None)
        if when > 0:
            record.created = when
            record.msecs = (when - int(when)) * 1000
        logger.handle(record)


def flush() -> None:
    """Hands every line the library has logged so far to logging, now, on this thread."""
    if _ext is None:
        return
    with _lock:
        sync_level()
        _emit(_ext.log_take())


def _pump() -> None:
    while not _stop:
        _ext.log_wait(_POLL_S)  # lines are taken under _lock only: flush() sees them all
        flush()


def _start() -> None:
    global _thread
    _thread = threading.Thread(target=_pump, name="ferry-log", daemon=True)
    _thread.start()


def _at_exit() -> None:
    # The pump thread ends here: a daemon thread still inside log_wait when the interpreter
    # finalizes is ended by Python while in C++ (std::terminate, "terminate called without an
    # active exception"). Then the lines still queued, and stderr again for what the library
    # logs while it shuts down (engines closed after this point).
    global _stop
    _stop = True
    _ext.log_wake()
    if _thread is not None and _thread is not threading.current_thread():
        _thread.join(5.0)
    try:
        flush()
    finally:
        _ext.log_route(False)


def install(ext: Any) -> None:
    """Routes the library's log through logging (called once, by ``import ferry``)."""
    global _ext
    if _ext is not None:
        return
    _ext = ext
    sync_level()
    ext.log_route(True)
    _start()
    atexit.register(_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_start)  # the pump thread stayed in the parent
