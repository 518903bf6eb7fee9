"""The server fuzzed with requests generated from its own request models
(tests/fuzz_strategies.py): no request gets a 5xx or leaves a traceback in the log, the
server stays healthy, and a greedy victim's output is the same before, beside and after.

Two parts, both with fixed seeds (the same requests every run):
- per route, the app in process (Starlette's TestClient): Hypothesis draws the requests and,
  on a failure, shrinks it to a minimal request, which the failure quotes;
- a real `trt-spec serve` (its stderr in a file, read for tracebacks) with a victim stream
  beside the fuzzed requests (tests/fuzz_runner.py campaign, as scripts/fuzz_server.py).

TRT_SPEC_FUZZ_EXAMPLES sets the number of requests (default 400: a few seconds; `make fuzz`
runs 10,000 through scripts/fuzz_server.py).
"""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz_runner import campaign
from tests.fuzz_strategies import ROUTES, WEIGHTS, verdict
from tests.server_util import start_server

EXAMPLES = int(os.environ.get("TRT_SPEC_FUZZ_EXAMPLES", 400))
PER_ROUTE = max(20, EXAMPLES // 4)  # in process: cheap, so more of them
# a heavy request takes seconds (n x prompts x logprobs): a few of them, and none in the
# real server's share (scripts/fuzz_server.py sends them)
EXAMPLES_OF = {"heavy": max(3, PER_ROUTE // 20)}
LIGHT = {name: w for name, w in WEIGHTS.items() if name != "heavy"}
SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
           HealthCheck.large_base_example]


class Errors(logging.Handler):
    """The server's ERROR records (serve/server.py logs each 500 it answers)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def app(tiny_spec_engine):
    """The app in process, its scheduler thread running, and its error log."""
    from starlette.testclient import TestClient

    from trt_spec import LLM
    from trt_spec.serve.server import create_app

    llm = LLM(tiny_spec_engine, max_num_seqs=4)
    errors = Errors()
    logging.getLogger("trt_spec").addHandler(errors)
    try:
        with TestClient(create_app(llm.scheduler, "tiny"), raise_server_exceptions=False) as c:
            yield c, errors
    finally:
        logging.getLogger("trt_spec").removeHandler(errors)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fuzzed_route_gets_no_5xx(app, route):
    client, errors = app

    @settings(max_examples=EXAMPLES_OF.get(route, PER_ROUTE), derandomize=True, database=None,
              deadline=None, suppress_health_check=SLOW_OK)
    @given(call=ROUTES[route])
    def check(call):
        errors.records.clear()
        r = client.request(call.method, call.path, content=call.body,
                           headers={"Content-Type": "application/json"})
        problem = verdict(r.status_code, r.text)
        assert problem is None, f"{problem}\n{call!r}"
        logged = [e.getMessage() for e in errors.records]
        assert not logged, f"{r.status_code}, logged {logged}\n{call!r}"

    check()
    assert client.get("/health").status_code == 200


def test_fuzzing_a_real_server_leaves_it_healthy_and_the_victim_unchanged(tiny_spec_engine,
                                                                          tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = start_server(tiny_spec_engine, "--max-num-seqs", "4", stderr=log)
    try:
        run = campaign(server.url, EXAMPLES, seed_=0, log_path=log_path, pid=server.proc.pid,
                       weights=LIGHT)
    finally:
        assert server.stop() == 0
    assert run.tally.requests == EXAMPLES
    assert run.stream_runs > 0  # the victim stream ran beside the fuzzed requests
    assert run.health_status == 200
    assert run.failures == [], "\n".join(run.failures[:20])
