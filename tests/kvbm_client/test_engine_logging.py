"""``attach_engine_logging``: the connector's lines are visible in an engine process that
configured only its own loggers, and nothing is added where logging is configured already."""
from __future__ import annotations

import io
import logging

import pytest

from kvbm_client.logs import attach_engine_logging


@pytest.fixture
def bare_logging(monkeypatch):
    """An engine-like process: ``kvbm`` without handlers (restored after). The root logger's
    handlers are cleared by each test itself (:func:`bare_root`): pytest attaches its capture
    handler to the root logger after the fixtures are set up."""
    kvbm = logging.getLogger("kvbm")
    saved = (kvbm.handlers[:], kvbm.level, kvbm.disabled)
    kvbm.handlers.clear()
    yield kvbm
    kvbm.handlers[:] = saved[0]
    kvbm.setLevel(saved[1])
    kvbm.disabled = saved[2]


def bare_root(monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_info_lines_of_the_connector_reach_stderr(bare_logging, monkeypatch):
    bare_root(monkeypatch)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.delenv("DYN_LOG", raising=False)
    attach_engine_logging()
    attach_engine_logging()  # idempotent: one handler
    assert len(bare_logging.handlers) == 1
    logging.getLogger("kvbm.connector").info("kvbm: load_mode auto -> async (why)")
    logging.getLogger("kvbm.connector").debug("not at info")
    out = err.getvalue()
    assert "INFO" in out and "[kvbm kvbm.connector] kvbm: load_mode auto -> async (why)" in out
    assert "not at info" not in out


def test_dyn_log_debug_shows_the_decisions(bare_logging, monkeypatch):
    bare_root(monkeypatch)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("DYN_LOG", "warn,kvbm=debug")
    attach_engine_logging()
    logging.getLogger("kvbm.connector").debug("a decision")
    assert "a decision" in err.getvalue()


def test_nothing_is_added_where_logging_is_configured(bare_logging, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    attach_engine_logging()
    assert bare_logging.handlers == []
