"""`trt-spec serve --ray`: two replicas on a real local Ray (127.0.0.1, 2 CPUs, no dashboard;
one Ray instance for the module, started and stopped by the CLI process), driven by the
official openai client and raw HTTP, against the single-process server on the same engine.
The module's deployment routes by prefix (the default: an ingress reads each body and relays
it); one test deploys with --routing load (the proxy hands requests to the replicas).

The engine folder goes to the replicas through Ray's object store (--ship-engine) into a
cache folder of this test, and every replica checks --engine-checksum and every file's sha256.
The replicas sleep 20 ms after each step (--debug-step-delay), so a 200-token request (4 s) is
still running when a test kills its replica. The log format comes from a --config file
(json), and the driver's stderr, where Ray forwards the replicas' lines, is kept."""

import concurrent.futures as futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve tests need the ray extra: "
                                        "pip install -e '.[ray]'")
openai = pytest.importorskip("openai")

from tests.server_util import Server, free_port, start_server  # noqa: E402
from trt_spec.runtime.manifest import manifest_digest  # noqa: E402
from trt_spec.serve.ray_serve import ScalingConfig  # noqa: E402

EXTRA = {"ignore_eos": True}
SERVE_ARGS = ("--max-num-seqs", "2", "--debug-step-delay", "0.02")


def targets(path) -> list[dict]:
    """The replicas in the Prometheus file_sd file the driver keeps."""
    return json.loads(path.read_text()) if path.is_file() else []


def replica_metric(target: dict, name: str, **labels) -> float:
    return Server(None, f"http://{target['targets'][0]}", "tiny").metric(name, **labels)


def wait_for(condition, timeout: float):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (got := condition()):
            return got
        time.sleep(0.2)
    return None


@pytest.fixture(scope="module")
def ray_server(tiny_spec_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    # RAY_DEDUP_LOGS=0: Ray folds lines alike across replicas into "[repeated Nx across
    # cluster]", which hid one request's access line among others' in a CI run
    env = {**os.environ, "TRT_SPEC_ENGINE_CACHE": str(root / "cache"), "RAY_DEDUP_LOGS": "0"}
    sd = root / "targets.json"
    (root / "serve.toml").write_text('log-format = "json"\n')
    with open(root / "driver.log", "w") as log:
        s = start_server(tiny_spec_engine, "--ray", "--replicas", "2", "--ray-num-cpus", "2",
                         "--ship-engine", "--engine-checksum", manifest_digest(tiny_spec_engine),
                         "--metrics-targets", str(sd), "--config", str(root / "serve.toml"),
                         *SERVE_ARGS, timeout=150, env=env, stderr=log)
    assert wait_for(lambda: len(targets(sd)) == 2, 30), targets(sd)
    s.targets, s.cache, s.log = sd, root / "cache", root / "driver.log"
    yield s
    assert s.stop(timeout=60) == 0
    assert wait_for(lambda: not any(pid_alive(t) for t in targets(sd)), 30)  # Ray went too


def pid_alive(target: dict) -> bool:
    try:
        os.kill(int(target["labels"]["pid"]), 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def single_server(tiny_spec_engine):
    s = start_server(tiny_spec_engine, *SERVE_ARGS)
    yield s
    assert s.stop() == 0


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_replicas_loaded_the_shipped_checked_folder(ray_server, tiny_spec_engine):
    ts = targets(ray_server.targets)
    assert len({t["labels"]["replica"] for t in ts}) == 2
    assert {t["labels"]["manifest_sha256"] for t in ts} == {manifest_digest(tiny_spec_engine)}
    cached = list(ray_server.cache.iterdir())  # the object-store copy, one per node
    assert len(cached) == 1 and manifest_digest(cached[0]) == manifest_digest(tiny_spec_engine)
    models = client(ray_server).models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].model_extra["methods"] == \
        ["none", "vanilla", "ngram", "suffix", "hybrid", "auto"]


@pytest.mark.parametrize("method", ["none", "vanilla"])
def test_greedy_outputs_equal_the_single_process_server(ray_server, single_server, method):
    spec = {"method": method, **({"num_draft_tokens": 3} if method != "none" else {})}
    kw = dict(model="tiny", temperature=0, max_tokens=24,
              extra_body={**EXTRA, "speculative": spec})
    chats = [[{"role": "user", "content": c}] for c in ("a b c", "h i", "w1 w2 w3 w4")]
    a, b = client(ray_server), client(single_server)
    for messages in chats:
        ra = a.chat.completions.create(messages=messages, **kw)
        rb = b.chat.completions.create(messages=messages, **kw)
        assert ra.choices[0].message.content == rb.choices[0].message.content != ""
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [getattr(ra.usage, n) for n in counts] == [getattr(rb.usage, n) for n in counts]
        # the prefix cache: each side has read this prompt before or not (the replicas share
        # nothing), so its cached tokens are all but the last prompt token, or none
        for r in (ra, rb):
            assert r.usage.prompt_tokens_details.cached_tokens in (0, r.usage.prompt_tokens - 1)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           a.chat.completions.create(messages=messages, stream=True, **kw))
        assert streamed == rb.choices[0].message.content
    ta = a.completions.create(prompt="d e f g", **kw).choices[0].text
    assert ta == b.completions.create(prompt="d e f g", **kw).choices[0].text != ""


def test_errors_equal_the_single_process_server(ray_server, single_server):
    bad = [{"model": "nope", "prompt": "a"},  # 404
           {"model": "tiny", "prompt": "a", "temperature": -1},  # 400
           {"model": "tiny", "prompt": "a", "speculative": {"method": "eagle3"}}]  # 400
    for body in bad:
        ra = httpx.post(f"{ray_server.url}/v1/completions", json=body, timeout=30)
        rb = httpx.post(f"{single_server.url}/v1/completions", json=body, timeout=30)
        assert ra.status_code == rb.status_code >= 400 and ra.json() == rb.json()
    r = httpx.post(f"{ray_server.url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_concurrent_requests_spread_over_both_replicas(ray_server):
    ts = targets(ray_server.targets)
    name = "trt_spec:generation_tokens_total"
    before = [replica_metric(t, name) for t in ts]
    c = client(ray_server)

    def one(i):
        return c.completions.create(model="tiny", prompt=f"a b w{i}", max_tokens=40,
                                    temperature=0, extra_body=EXTRA).usage.completion_tokens

    # 2 KV slots and max_ongoing_requests 2 per replica: 8 at once cannot fit on one
    with futures.ThreadPoolExecutor(8) as pool:
        tokens = sum(pool.map(one, range(8)))
    gained = [replica_metric(t, name) - b for t, b in zip(ts, before)]
    assert tokens == 8 * 40 and sum(gained) == tokens
    assert all(g > 0 for g in gained), gained  # each replica's own /metrics saw its share


def test_a_killed_replica_is_replaced_and_the_endpoint_keeps_serving(ray_server):
    c = client(ray_server)
    before = targets(ray_server.targets)
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    plain, streamed = {}, {}

    def long_plain():  # not streamed: the answer comes at the end, or a status
        r = httpx.post(f"{ray_server.url}/v1/completions", json=body, timeout=60)
        plain.update(status=r.status_code, text=r.text[:300])

    def long_stream():
        try:
            with httpx.stream("POST", f"{ray_server.url}/v1/completions",
                              json={**body, "stream": True}, timeout=60) as r:
                streamed["status"] = r.status_code
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            streamed["done"] = bool(lines) and lines[-1] == "data: [DONE]"
            streamed["error_event"] = any('"error"' in line for line in lines)
        except httpx.HTTPError as e:
            streamed["exception"] = type(e).__name__

    def running(t):
        return replica_metric(t, "trt_spec:num_requests_running")

    with futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(long_plain)]
        busy = wait_for(lambda: [t for t in before if running(t) == 1], 10)
        assert busy, f"the long request never started: {plain}"
        victim = busy[0]
        jobs.append(pool.submit(long_stream))
        assert wait_for(lambda: sum(running(t) for t in before) == 2, 10), streamed
        stream_on_victim = running(victim) == 2
        os.kill(int(victim["labels"]["pid"]), signal.SIGKILL)
        for job in jobs:
            job.result(timeout=60)  # nothing hangs
    # the request running on the dead replica fails with a 5xx; a stream there is cut (its
    # 200 was sent long ago): no [DONE]; a stream on the other replica ends normally
    # the ingress answers for the dead replica in OpenAI's error shape
    assert plain["status"] == 503 and "replica serving this request stopped" in plain["text"], \
        plain
    if stream_on_victim:
        assert not streamed.get("done") and (streamed.get("exception")
                                             or streamed.get("error_event")), streamed
    else:
        assert streamed["done"] and not streamed["error_event"], streamed

    # new requests are answered while Ray Serve replaces the replica
    for i in range(6):
        r = c.completions.create(model="tiny", prompt=f"x w{i}", max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
    survivor = {t["labels"]["pid"] for t in before} - {victim["labels"]["pid"]}

    def replaced():
        now = targets(ray_server.targets)
        pids = {t["labels"]["pid"] for t in now}
        return len(now) == 2 and survivor <= pids and victim["labels"]["pid"] not in pids

    assert wait_for(replaced, 90), targets(ray_server.targets)
    fresh = next(t for t in targets(ray_server.targets) if t["labels"]["pid"] not in survivor)
    assert replica_metric(fresh, "trt_spec:kv_cache_slots_total") == 2
    assert httpx.get(f"{ray_server.url}/health", timeout=10).json() == {"status": "ok"}


def total(server, name, **labels) -> float:
    """A counter summed over the live replicas."""
    return sum(replica_metric(t, name, **labels) for t in targets(server.targets))


def test_a_chats_later_turns_reach_the_replica_holding_its_history(ray_server):
    """Each later turn finds its whole history in the cache of the replica it reached. Routed
    by load instead, each of the 8 later turns would have one chance in two."""
    c = client(ray_server)
    for n in range(4):
        messages = [{"role": "user", "content": f"chat {n}: " + "w1 w2 w3 " * 20}]
        previous = None
        for turn in range(3):
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0, extra_body=EXTRA)
            cached = r.usage.prompt_tokens_details.cached_tokens
            if previous is not None:
                assert cached >= previous - 1, (n, turn, cached, previous)
            previous = r.usage.prompt_tokens
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"w{turn} again"}]


def test_a_client_gone_mid_stream_stops_its_request_on_the_replica(ray_server):
    aborted = total(ray_server, "trt_spec:request_success_total", finished_reason="abort")
    finished = total(ray_server, "trt_spec:request_success_total", finished_reason="length")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "gone soon"}],
            "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{ray_server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(lines)
    # the ingress's request is cancelled, then the relay on the replica: the request aborts
    # (200 tokens at 20 ms a step would have finished with "length" after 4 s)
    assert wait_for(lambda: total(ray_server, "trt_spec:request_success_total",
                                  finished_reason="abort") == aborted + 1, 30)
    assert total(ray_server, "trt_spec:request_success_total",
                 finished_reason="length") == finished


def test_routing_by_load_serves_straight_from_the_proxy(tiny_spec_engine, single_server):
    s = start_server(tiny_spec_engine, "--ray", "--routing", "load", "--ray-num-cpus", "2",
                     *SERVE_ARGS, timeout=150)
    try:
        messages = [{"role": "user", "content": "h i"}]
        kw = dict(model="tiny", messages=messages, temperature=0, max_tokens=16,
                  extra_body=EXTRA)
        want = client(single_server).chat.completions.create(**kw).choices[0].message.content
        assert client(s).chat.completions.create(**kw).choices[0].message.content == want
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           client(s).chat.completions.create(stream=True, **kw))
        assert streamed == want
        r = httpx.get(f"{s.url}/v1/models", headers={"x-request-id": "load-1"}, timeout=30)
        assert r.headers.get_list("x-request-id") == ["load-1"]  # the proxy's, once
    finally:
        assert s.stop(timeout=60) == 0


def replica_access_lines(server) -> list[dict]:
    """The replicas' JSON access lines, as Ray forwards them to the driver's stderr (each
    behind Ray's "(ServeReplica:... pid=...)" prefix, maybe with its "[repeated 2x across
    cluster]" after)."""
    out = []
    for line in server.log.read_text(errors="replace").splitlines():
        if "ServeReplica" in line and '{"time"' in line:
            entry, _ = json.JSONDecoder().raw_decode(line[line.index('{"time"'):])
            if entry["logger"] == "trt_spec.access":
                out.append(entry)
    return out


def test_replicas_log_as_the_config_file_says(ray_server):
    """--config's log-format reached the replicas: their access lines are JSON, with the
    request's id, which the response returns once (the proxy's header, not a second). Ray's
    log monitor forwards a replica's lines in batches: on a loaded 2-core machine one took
    over 30 s, so the wait is generous."""
    r = httpx.post(f"{ray_server.url}/v1/chat/completions", timeout=60,
                   headers={"x-request-id": "ray-access-1"},
                   json={"model": "tiny", "max_tokens": 4, "temperature": 0, **EXTRA,
                         "messages": [{"role": "user", "content": "a b"}]})
    assert r.status_code == 200
    assert r.headers.get_list("x-request-id") == ["ray-access-1"]
    entry = wait_for(lambda: next((e for e in replica_access_lines(ray_server)
                                   if e["request_id"] == "ray-access-1"), None), 120)
    assert entry, ray_server.log.read_text()[-2000:]
    assert (entry["route"], entry["status"], entry["model"], entry["completion_tokens"]) == \
        ("POST /v1/chat/completions", 200, "tiny", 4)


def test_scaling_options_map_onto_ray_serve():
    assert ScalingConfig(replicas=3, max_ongoing_requests=4).deployment_options() == {
        "num_replicas": 3, "max_ongoing_requests": 4, "ray_actor_options": {"num_cpus": 1.0},
        "graceful_shutdown_timeout_s": 60.0}
    auto = ScalingConfig(replicas=2, min_replicas=1, max_replicas=4,
                         target_ongoing_requests=3).deployment_options()
    assert "num_replicas" not in auto and auto["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
        "target_ongoing_requests": 3}
    with pytest.raises(ValueError, match="min_replicas=3, max_replicas=2"):
        ScalingConfig(min_replicas=3, max_replicas=2)


def test_a_replica_refuses_a_corrupt_folder(tiny_spec_engine, tmp_path):
    """The object-store copy on the node is corrupt (a half-written cache, a bad disk): the
    replica's sha256 check refuses it and the deployment fails with the file named."""
    cache = tmp_path / "cache"
    folder = cache / f"{tiny_spec_engine.name}-{manifest_digest(tiny_spec_engine)[:16]}"
    folder.mkdir(parents=True)
    for f in tiny_spec_engine.iterdir():
        folder.joinpath(f.name).write_bytes(f.read_bytes())
    data = folder / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    env = {**os.environ, "TRT_SPEC_ENGINE_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-m", "trt_spec.cli", "serve", "--engine",
                             str(tiny_spec_engine), "--ray", "--ship-engine", "--ray-num-cpus",
                             "2", "--port", str(free_port()), "--threads", "1"],
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: the Ray Serve deployment failed"), last
    assert "target.onnx.data: checksum differs" in result.stderr
