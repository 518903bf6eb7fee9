"""`trt-spec serve`: an OpenAI-compatible HTTP server (serve/server.py), or replicas on Ray
Serve with --ray (serve/ray_serve.py)."""

from __future__ import annotations

import click

from trt_spec.cli.config import configurable
from trt_spec.cli.options import (RUNTIME, backend_options, chat_template_option, engine_option,
                                  fail, memory_option, methods_help, runtime_config,
                                  speculation_options, threads_option)
from trt_spec.runtime.options import defaults, from_options
from trt_spec.runtime.settings import SERVE_MAX_BATCH
from trt_spec.serve.options import LOG_FORMATS, ROUTINGS, RayOptions, ServeOptions

SERVE, RAY = defaults(ServeOptions), defaults(RayOptions)


def default_method(engine: str) -> str:
    """auto where the folder has a model drafter, else none (a folder that cannot be read is
    reported by the server's load, with its reason)."""
    from trt_spec.runtime.manifest import load_manifest

    try:
        return "auto" if load_manifest(engine, verify="none").data.get("drafters") else "none"
    except Exception:  # noqa: BLE001 - the load that follows names the problem
        return "none"


@configurable
@click.command()
@engine_option
@click.option("--host", default=SERVE["host"], show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=SERVE["port"], show_default=True,
              help="Port to listen on.")
@click.option("--served-model-name", default=None,
              help="The model id clients send [default: the engine folder's name].")
@click.option("--method", default=None,
              help=methods_help("Default method for requests that do not set "
                                "speculative.method [default: auto where the engine folder "
                                "has a drafter, else none]:"))
@speculation_options
@click.option("--max-num-seqs", type=click.IntRange(1, 256), default=SERVE_MAX_BATCH,
              show_default=True,
              help="KV-cache slots: requests decoding together (continuous batching).")
@click.option("--max-model-len", type=click.IntRange(min=2), default=RUNTIME.max_len,
              show_default=True,
              help="Context per request (prompt + output), capped by the model's.")
@click.option("--max-waiting", type=click.IntRange(min=0), default=RUNTIME.max_waiting,
              show_default=True,
              help="Requests queued for a slot; past this, 429.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0),
              default=SERVE["shutdown_timeout"],
              show_default=True, help="On SIGTERM, seconds to let in-flight requests finish; "
                                      "past it each gets an error event (or a 503).")
@click.option("--max-prefill-tokens", type=click.IntRange(min=1),
              default=RUNTIME.max_prefill_tokens,
              show_default=True, help="Prompt tokens prefilled per step: a longer prompt is "
                                      "read in chunks while other streams keep decoding.")
@click.option("--prefix-cache/--no-prefix-cache", default=RUNTIME.prefix_cache,
              show_default=True,
              help="Keep a finished request's KV rows: a prompt that starts with them (a chat's "
                   "next turn, a shared system prompt) reads only the rest.")
@click.option("--escape-special-tokens/--no-escape-special-tokens",
              default=RUNTIME.escape_special_tokens, show_default=True,
              help="Read special tokens written in a prompt string or a message's content "
                   "(e.g. '<|im_end|>') as plain text, not as control tokens; the chat "
                   "template's own stay special.")
@chat_template_option
@click.option("--cost-cache/--no-cost-cache", default=True, show_default=True,
              help="Keep the step costs the engine measures (the speculation policy's input) "
                   "in the user's cache folder, keyed by engine and machine: a later server "
                   "reads them instead of timing its first requests.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=SERVE["max_body_bytes"],
              show_default=True, help="Largest request body; past it, 413.")
@click.option("--api-key", default=None,
              help="Require `Authorization: Bearer KEY` on every route but /health and "
                   "/metrics (401 otherwise).")
@click.option("--protect-metrics", is_flag=True,
              help="/metrics needs the API key too.")
@click.option("--allowed-origins", multiple=True, metavar="ORIGINS",
              help="CORS: browser origins allowed to call the server, comma-separated or "
                   "repeated (https://app.example.com, or * for any) [default: none].")
@click.option("--reasoning-in-content", is_flag=True,
              help="Keep a reasoning model's thinking section in `content` [default: apart, "
                   "as `reasoning_content`].")
@click.option("--docs", is_flag=True,
              help="Serve the API's OpenAPI schema at /openapi.json and its pages at /docs and "
                   "/redoc (which load their scripts from a CDN) [default: off].")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True),
              default=SERVE["header_timeout"], show_default=True,
              help="Seconds from a request's first byte to the end of its headers; past it, "
                   "408 and the connection is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True),
              default=SERVE["body_timeout"], show_default=True,
              help="Seconds from the end of a request's headers to the end of its body; past "
                   "it, 408 and the connection is closed.")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True),
              default=SERVE["keep_alive_timeout"], show_default=True,
              help="Seconds a connection may stay idle (new, or between requests) before it "
                   "is closed.")
@click.option("--max-header-bytes", type=click.IntRange(min=1),
              default=SERVE["max_header_bytes"], show_default=True,
              help="Largest request line plus headers; past it, 431.")
@click.option("--max-connections", type=click.IntRange(min=1),
              default=SERVE["max_connections"], show_default=True,
              help="Open connections; a new one past it gets a 503 and is closed.")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1),
              default=SERVE["max_concurrent_requests"], show_default=True,
              help="Requests in flight (a stream until it ends); past it, 503 with "
                   "Retry-After (/health and /metrics always answer).")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default=SERVE["log_format"],
              show_default=True,
              help="The log's lines on stderr: text, or one JSON object per line (time, "
                   "level, logger, message, and an access line's fields).")
@click.option("--access-log/--no-access-log", default=SERVE["access_log"], show_default=True,
              help="One line per request: its id (the x-request-id header, or one made and "
                   "returned in that header), route, status, model, method, prompt, cached "
                   "and completion tokens, time to first token, total time and tau.")
@click.option("--debug-step-delay", type=click.FloatRange(min=0),
              default=SERVE["debug_step_delay"], hidden=True,
              help="Sleep this long after each step (tests: a slower model).")
@threads_option
@backend_options
@memory_option
@click.option("--ray", "use_ray", is_flag=True,
              help="Deploy on Ray Serve: --replicas engines behind one HTTP endpoint "
                   "(pip install 'trt-spec[ray]').")
@click.option("--replicas", type=click.IntRange(min=1), default=RAY["replicas"],
              show_default=True,
              help="--ray: replicas (the initial count when autoscaling).")
@click.option("--ray-address", default=None,
              help="--ray: join this Ray cluster (e.g. auto, 10.0.0.1:6379) [default: start a "
                   "local Ray].")
@click.option("--min-replicas", type=click.IntRange(min=0), default=None,
              help="--ray: autoscale, at least this many replicas.")
@click.option("--max-replicas", type=click.IntRange(min=1), default=None,
              help="--ray: autoscale, at most this many replicas.")
@click.option("--target-ongoing-requests", type=click.FloatRange(min=0, min_open=True),
              default=None, help="--ray: autoscale towards this many ongoing requests per "
                                 "replica (Ray Serve's target_ongoing_requests).")
@click.option("--max-ongoing-requests", type=click.IntRange(min=1), default=None,
              help="--ray: requests a replica holds at once; more wait in Ray Serve's router "
                   "[default: --max-num-seqs].")
@click.option("--replica-cpus", type=click.FloatRange(min=0), default=RAY["replica_cpus"],
              show_default=True,
              help="--ray: CPUs Ray reserves per replica.")
@click.option("--ship-engine", is_flag=True,
              help="--ray: send the engine folder to replicas through Ray's object store "
                   "[default: it is at the same path on every node].")
@click.option("--engine-checksum", default=None,
              help="--ray: every replica refuses an engine folder whose manifest.json sha256 "
                   "differs (`sha256sum ENGINE/manifest.json`).")
@click.option("--metrics-targets", type=click.Path(dir_okay=False), default=None,
              help="--ray: keep a Prometheus file_sd JSON of the replicas' /metrics here.")
@click.option("--routing", type=click.Choice(ROUTINGS), default=RAY["routing"],
              show_default=True,
              help="--ray: prefix sends a chat's every turn (a prompt's same opening) to the "
                   "replica holding its earlier turns, through a small ingress that reads the "
                   "body; load sends each request to the less loaded of two replicas.")
@click.option("--ray-num-cpus", type=click.IntRange(min=1), default=None,
              help="--ray without --ray-address: CPUs of the local Ray [default: all].")
def serve(engine, method, use_ray, engine_checksum, **options):
    """Serve ENGINE over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /tokenize, /detokenize, /tokenizer_info, /health, /metrics); with --ray, as
    replicas on Ray Serve."""
    from trt_spec.serve.server import serve_engine

    # the other options are fields of RuntimeConfig, ServeOptions and RayOptions, by name
    try:
        runtime = runtime_config({**options, "method": method or default_method(engine)})
    except ValueError as e:
        fail(e)
    origins = tuple(o.strip() for given in options.pop("allowed_origins")
                    for o in given.split(",") if o.strip())
    try:
        serve_options = from_options(ServeOptions, options, engine=engine, runtime=runtime,
                                     allowed_origins=origins)
    except ValueError as e:
        fail(e)
    say = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if not use_ray:
        try:
            serve_engine(serve_options, say)
        except ValueError as e:
            fail(e)
        return
    try:
        from trt_spec.serve import ray_serve
    except ImportError as e:
        raise click.ClickException(f"--ray needs Ray Serve ({e}); install it with "
                                   "pip install 'trt-spec[ray]'") from None
    try:
        ray_serve.serve_on_ray(serve_options, from_options(RayOptions, options),
                               engine_checksum, say)
    except (ValueError, ray_serve.DeploymentError) as e:
        fail(e)
