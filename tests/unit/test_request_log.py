"""Where the router's per-request trace lines go (docs/operating.md, Traces)."""

import io
import json
import logging
import sys
from logging.handlers import MemoryHandler

import pytest
from ray.serve._private.logging_utils import StreamToLogger

from cluster.router import request_log
from cluster.router.request_log import RequestLog, configure_trace_logging


@pytest.fixture
def trace_logger():
    saved = request_log.logger.handlers[:]
    request_log.logger.handlers.clear()
    yield request_log.logger
    request_log.logger.handlers[:] = saved


def test_a_trace_line_reaches_the_replicas_stderr_at_once_under_serves_throughput_mode(trace_logger, monkeypatch):
    """Under RAY_SERVE_THROUGHPUT_OPTIMIZED=1 Serve swaps a replica's sys.stderr for a writer
    into its logger, whose records wait in a 1,000-record buffer: a trace written there would
    show up in no log until a thousand requests later. It goes to the process's own stderr."""
    process_stderr = io.StringIO()
    serve_logger = logging.getLogger("test.serve.replica")
    held = MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL, target=logging.NullHandler())
    serve_logger.addHandler(held)
    monkeypatch.setattr(sys, "__stderr__", process_stderr)
    monkeypatch.setattr(sys, "stderr", StreamToLogger(serve_logger, logging.INFO, process_stderr))
    configure_trace_logging()
    RequestLog("router-1").record({"request_id": "req-7", "id": "req-7", "ttft_s": 0.12})
    lines = process_stderr.getvalue().splitlines()
    assert [json.loads(line) for line in lines] == [{"request_id": "req-7", "id": "req-7", "ttft_s": 0.12}]
    assert held.buffer == []  # none of it went through Serve's buffer
    serve_logger.removeHandler(held)
