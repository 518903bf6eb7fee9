"""Prefix routing on Ray Serve: a chat's turns reach the replica that holds its KV rows.

    client ──> Ray Serve proxy ──> PrefixIngress ──(key)──> EngineReplica.relay on the
                                   reads the body,            replica PrefixRouter ranks
                                   keys it (serve/affinity)   first for the key

Ray Serve's proxy hands a replica the request before its body is read, so the body is read
by a small ingress deployment first; it keys the request by the conversation's opening and
relays it (serve/asgi_relay.py) through a deployment handle whose router, PrefixRouter, tries
the key's first replica, then its next two (rendezvous order), then any two, each only while
it has room (max_ongoing_requests): a chat stays on its replica until that one is full.
Requests without a key (/metrics, /v1/models, ...) go to the less loaded of two replicas.

Imported only by serve/ray_serve.py (`serve --ray`); Ray Serve imports PrefixRouter by name
in the process that routes.
"""

from __future__ import annotations

import logging
import random

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from trt_spec.serve.affinity import rank, route_key
from trt_spec.serve.asgi_relay import read_request, write_response

log = logging.getLogger("trt_spec.ray_serve")
ROUTER_CLASS = "trt_spec.serve.ray_routing.PrefixRouter"


class PrefixRouter(RequestRouter):
    """Ranks replicas for a request's `key` keyword (rendezvous hashing); no key: two at
    random, the less loaded taken (Ray Serve's power of two choices)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait, retry
        key = pending_request.kwargs.get("key") if pending_request is not None else None
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        order = [by_id[i] for i in rank(key, list(by_id))]
        ranks = [order[:1], order[1:3]]
        if len(order) > 3:
            ranks.append(random.sample(order[3:], min(2, len(order) - 3)))
        return [r for r in ranks if r]


def relay_failure(e: Exception) -> tuple[int, str]:
    """What the client is told when the replica (or the way to it) failed."""
    name = type(e).__name__
    if "ActorDied" in name or "ActorUnavailable" in name or "Unavailable" in name:
        return 503, "the replica serving this request stopped; retry the request"
    return 500, f"the replica failed this request: {name}"


class RelayApp:
    """The ingress's ASGI app: reads each request, keys it, and relays it to
    EngineReplica.relay through PrefixRouter, streaming the answer back."""

    def __init__(self, engine):
        self.engine = engine.options(stream=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":  # nothing to start or stop here
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        try:
            head, body = await read_request(scope, receive)
        except ConnectionError:
            return
        answer = self.engine.relay.remote(head, body, key=route_key(head["path"], body))
        try:
            await write_response(send, answer, relay_failure)
        finally:
            answer.cancel()  # a client gone mid-answer: the replica stops generating


class PrefixIngress:
    """The application's HTTP entry under prefix routing (a deployment of one replica)."""

    def __init__(self, engine):
        self.relay_app = RelayApp(engine)

    def __serve_build_asgi_app__(self):
        return self.relay_app


def ingress_deployment(max_ongoing_requests: int = 1000):
    """The ingress, one replica with no CPU reserved: it only moves bytes."""
    return serve.deployment(serve.ingress()(PrefixIngress), name="PrefixIngress",
                            max_ongoing_requests=max_ongoing_requests,
                            ray_actor_options={"num_cpus": 0})
