"""The library's log lines through Python's logging (issue 33): they wrote to stderr, raw
epoch seconds first, with no control from Python."""

from __future__ import annotations

import logging

import numpy as np

import ferry
import ferry.kv as fkv


def _lines(caplog, level=logging.DEBUG):
    ferry._log.flush()
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records
            if r.name.startswith("ferry") and r.levelno >= level]


def _connector(engine):
    lay = fkv.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, elem_size=2, block_size=16,
                       num_blocks=8)
    return fkv.KvConnector(engine, lay, np.zeros(lay.region_bytes // 2, dtype=np.int16))


def _prefill_done_twice(engine):
    with _connector(engine) as conn:
        conn.prefill_done(7, [2], 10)
        conn.prefill_done(7, [2], 10)  # the library warns and ignores it


def test_library_warning_is_a_logging_record(caplog, capfd):
    """A warning of the library is a record of the logger ferry.kv, with its message, and not
    a line of its own on stderr."""
    caplog.set_level(logging.WARNING)
    with ferry.TransferEngine("tcp", same_host=True) as engine:
        _prefill_done_twice(engine)
    want = ("ferry.kv", logging.WARNING,
            "transfer 0x7: prefill_done called twice or after a failure; ignored")
    assert want in _lines(caplog)
    assert "prefill_done called twice" not in capfd.readouterr().err


def test_level_of_the_ferry_logger_controls_the_library(caplog, capfd):
    """logging.getLogger("ferry").setLevel(...) sets what the library logs: ERROR silences its
    warnings (on stderr too), DEBUG brings its info lines (the engine's provider)."""
    logger = logging.getLogger("ferry")
    old = logger.level
    try:
        caplog.set_level(logging.DEBUG)
        logger.setLevel(logging.ERROR)
        with ferry.TransferEngine("tcp", same_host=True) as engine:
            _prefill_done_twice(engine)
        assert _lines(caplog) == []
        assert capfd.readouterr().err == ""
        logger.setLevel(logging.DEBUG)
        with ferry.TransferEngine("tcp", same_host=True):
            pass
        info = [m for n, lvl, m in _lines(caplog) if n == "ferry.fabric" and
                lvl == logging.INFO]
        assert any("provider tcp" in m for m in info), _lines(caplog)
    finally:
        logger.setLevel(old)
