"""Fixtures shared by mtl-train's tests."""

import logging

import pytest


@pytest.fixture
def mtl_log():
    """Every record the ``mtl`` loggers emit (they do not propagate to the root logger)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger("mtl")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
