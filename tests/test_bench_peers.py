"""`trt-spec bench --peers / --plot`: option checks, the interleaved order, the peers' fields
and pairwise ratios, skipped peers, the plot; the HF draft conversion and the transformers
peers on the tiny model. Real peers (onnxruntime-genai, llama.cpp) only where installed."""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest
from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.tools import peers as peer_registry
from trt_spec.tools.bench_peers import valid_json
from trt_spec.tools.peers import PeerContext, parse_peers
from trt_spec.runtime.scheduler import generate_ids

N = 6  # new tokens per run


def write_prompts(tmp_path, n: int = 3):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"a b {chr(ord('c') + i)}"}) + "\n"
                            for i in range(n)))
    return path


def test_parse_peers():
    assert parse_peers("transformers, llama.cpp,transformers") == ["transformers", "llama.cpp"]
    assert parse_peers("") == []
    with pytest.raises(ValueError, match="'vllm' is not a peer; choose from transformers, "
                                         "transformers-assisted, onnxruntime-genai, "
                                         "onnxruntime-genai-ngram, onnxruntime-genai-draft, "
                                         "llama.cpp, llama.cpp-draft, llama.cpp-ngram, "
                                         "openvino, openvino-lookup"):
        parse_peers("transformers,vllm")


@pytest.mark.parametrize("args, message", [
    (["--peers", "tgi"], "--peers: 'tgi' is not a peer; choose from"),
    (["--peers", "transformers", "--batch", "2"], "--peers runs at batch 1 only; got --batch 2"),
])
def test_bench_peers_bad_input(tiny_engine, args, message):
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine)] + args)
    assert result.exit_code != 0 and message in result.output


@pytest.fixture
def fake_peers(monkeypatch, tiny_engine):
    """Registers fake peers; returns the event log every run of ours and theirs appends to."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.tools import bench as bench_module

    events = []
    real_generate_ids = bench_module.generate_ids

    def generate_ids(gen, prompts_ids, params, method=None, num_draft_tokens=None):
        proposer = gen.proposer(method or gen.method)  # method none has none
        events.append(("ours", type(proposer).__name__, tuple(prompts_ids[0])))
        return real_generate_ids(gen, prompts_ids, params, method, num_draft_tokens)

    monkeypatch.setattr(bench_module, "generate_ids", generate_ids)

    class Echo:
        """Our own engine, method none, behind the peer interface: identical output; a fixed
        rate so the ratios can be checked."""
        name, precision, num_draft_tokens, rate = "echo", "fp32 (ours)", None, 100.0

        def __init__(self):
            self.engine, self.gen = "echo peer", None

        def available(self):
            return True, ""

        def load(self, ctx: PeerContext):
            assert ctx.threads >= 1 and ctx.num_draft_tokens == 2
            self.gen = Generator(str(tiny_engine))

        def holds_schemas(self):
            return True, ""

        def generate(self, prompt_ids, max_new_tokens, temperature, seed, json_schema=None):
            from trt_spec.runtime.sampling import SamplingParams

            events.append((self.name, None, tuple(prompt_ids)))
            s = real_generate_ids(self.gen, [prompt_ids], SamplingParams(
                max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                ignore_eos=True, json_schema=json_schema))[0]
            return {"tokens_per_s": self.rate, "completion_tokens": len(s.output_ids),
                    "target_forwards": None, "ttft_s": 0.001, "output_ids": s.output_ids}

        def close(self):
            self.gen = None

    class Echo2(Echo):
        name, rate = "echo2", 50.0

    class Missing(Echo):
        name = "missing"

        def available(self):
            return False, "missing-runtime is not installed"

    class BrokenLoad(Echo):
        name = "broken-load"

        def load(self, ctx):
            raise RuntimeError("weights not found")

    class BrokenRun(Echo):
        name = "broken-run"

        def generate(self, *args):
            raise ConnectionError("server died")

    for cls in (Echo, Echo2, Missing, BrokenLoad, BrokenRun):
        monkeypatch.setitem(peer_registry.PEERS, cls.name, cls)
    return events


def test_bench_with_fake_peers(fake_peers, tiny_engine, tmp_path):
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, [
        "bench", "--engine", str(tiny_engine), "--prompts", str(write_prompts(tmp_path)),
        "--methods", "ngram", "--num-draft-tokens", "2", "--max-new-tokens", str(N),
        "--repeats", "2", "--peers", "echo,missing,broken-load,echo2,broken-run",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())

    # interleaved: per workload, every configuration of ours (none, none-fast, ngram), then
    # every peer, on the same prompt ids; warm-up first. broken-run is dropped at its first run.
    kinds = [(who, method) for who, method, _ in fake_peers]
    step = [("ours", "NoneType"), ("ours", "NoneType"), ("ours", "NgramProposer"),
            ("echo", None), ("echo2", None)]
    assert kinds == step * (1 + 2 * 3), kinds
    for i in range(0, len(fake_peers), 5):
        assert len({ids for _, _, ids in fake_peers[i:i + 5]}) == 1  # the same prompt

    assert report["skipped_peers"] == {
        "missing": "missing-runtime is not installed",
        "broken-load": "load failed: RuntimeError: weights not found",
        "broken-run": "failed while running: ConnectionError: server died"}
    for name, reason in report["skipped_peers"].items():
        assert f"skipped peer {name}: {reason}" in result.stdout
    # every row shows its time to first token and peak memory; each peer is named with what
    # it runs (its version, where it has one)
    header = next(line for line in result.stdout.splitlines() if line.startswith("engine"))
    assert "ttft ms" in header and "rss MB" in header
    for r in report["results"]:
        assert r["ttft_ms"] is not None and r["peak_rss_mb"] > 0
        if r.get("peer"):
            assert f"peer {r['method']}: {r['engine']}" in result.stdout

    results = {r["method"]: r for r in report["results"]}
    assert set(results) == {"none", "none-fast", "ngram", "echo", "echo2"}
    none_runs = results["none"]["tokens_per_s"]["runs"]
    assert len(none_runs) == 2 * 3
    for name, rate in (("echo", 100.0), ("echo2", 50.0)):
        r = results[name]
        assert r["peer"] and r["engine"] == "echo peer" and r["precision"] == "fp32 (ours)"
        assert r["tokens_per_s"]["runs"] == [rate] * 6
        assert r["tau"] is None and r["acceptance_rate"] is None
        assert r["identical_to_baseline"] == 1.0  # greedy, the same fp32 graph
        assert r["speedup_vs_none"] == pytest.approx(rate / statistics.median(none_runs))
        assert r["ratio_pairwise"] == pytest.approx(statistics.median(rate / x for x in none_runs))
    for method in ("none", "ngram"):
        runs = results[method]["tokens_per_s"]["runs"]
        assert results[method]["vs_peers"] == pytest.approx(
            {"echo": statistics.median(x / 100.0 for x in runs),
             "echo2": statistics.median(x / 50.0 for x in runs)})
    assert "ours / peer" in result.stdout and "echo2" in result.stdout


def test_a_sweeping_peer_runs_once_per_k(fake_peers, monkeypatch, tiny_engine, tmp_path):
    """A peer that sweeps k (SWEEPS_K) gets a row per integer --num-draft-tokens ('auto' is
    its own adaptive k, not a row), each loaded with its k and named by it."""
    echo = peer_registry.PEERS["echo"]
    loaded = []

    class Sweep(echo):
        name, SWEEPS_K = "sweep", True

        def load(self, ctx):
            loaded.append(ctx.num_draft_tokens)
            self.num_draft_tokens = ctx.num_draft_tokens
            self.gen = __import__("trt_spec.runtime.generator", fromlist=["Generator"]).Generator(
                str(tiny_engine))

    monkeypatch.setitem(peer_registry.PEERS, "sweep", Sweep)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, [
        "bench", "--engine", str(tiny_engine), "--prompts", str(write_prompts(tmp_path, 2)),
        "--methods", "ngram", "--num-draft-tokens", "2,1,auto", "--max-new-tokens", str(N),
        "--repeats", "1", "--peers", "sweep,echo", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert loaded == [1, 2]
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"] if r.get("peer")}
    assert set(rows) == {"sweep k=1", "sweep k=2", "echo"}
    assert rows["sweep k=1"]["num_draft_tokens"] == 1 and rows["sweep k=2"]["num_draft_tokens"] == 2
    assert rows["echo"]["num_draft_tokens"] is None
    assert "sweep k=1 " in result.stdout and "sweep k=1 k=1" not in result.stdout


def test_peer_ks():
    from trt_spec.tools.peers import peer_ks

    class Plain:
        pass

    class Sweeping:
        SWEEPS_K = True

    assert peer_ks(Plain, [1, 2, "auto"]) == [None]
    assert peer_ks(Sweeping, [4, 1, "auto", 4]) == [1, 4]
    assert peer_ks(Sweeping, ["auto"]) == [4]


# --- under a JSON schema ------------------------------------------------------------------------

# The tiny tokenizer is word-level: its decode joins words with spaces, while the grammar reads
# the tokens' text concatenated. These tests decode as the grammar reads, so that an answer
# the grammar finished ("t r u e") is the JSON it spells ("true").
SCHEMAS = [{"type": "boolean"}, {"type": "null"}, {"type": "boolean"}]


@pytest.fixture
def concatenating_decode(monkeypatch):
    from trt_spec.runtime.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, skip_special_tokens=True: "".join(
        self.token_bytes(t).decode() for t in ids if t not in self.special_ids))


def write_schema_prompts(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"a b {chr(ord('c') + i)}", "json_schema": s})
                            + "\n" for i, s in enumerate(SCHEMAS)))
    return path


def test_bench_peers_under_a_schema(fake_peers, concatenating_decode, monkeypatch, tiny_engine,
                                    tmp_path):
    """Prompts with a json_schema: every peer gets the schema; one that cannot hold its
    output to one is skipped with its reason; every row says how many answers validate and
    how it compares with the fastest peer configuration; a speculating peer says whether it
    equals its own plain output under the schema."""
    echo = peer_registry.PEERS["echo"]
    seen = []

    class Schemaless(echo):
        name = "schemaless"

        def holds_schemas(self):
            return False, "it has no structured output"

    class Speculating(echo):
        """Answers with its prompt (not JSON) and says it differs from its plain output."""
        name, rate, num_draft_tokens = "speculating", 25.0, 3

        def generate(self, prompt_ids, max_new_tokens, temperature, seed, json_schema=None):
            seen.append(json_schema)
            return {"tokens_per_s": self.rate, "completion_tokens": len(prompt_ids),
                    "target_forwards": None, "ttft_s": 0.002, "output_ids": list(prompt_ids),
                    "same_as_own_plain": False}

    for cls in (Schemaless, Speculating):
        monkeypatch.setitem(peer_registry.PEERS, cls.name, cls)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, [
        "bench", "--engine", str(tiny_engine), "--prompts", str(write_schema_prompts(tmp_path)),
        "--methods", "ngram", "--num-draft-tokens", "2", "--max-new-tokens", "12",
        "--repeats", "1", "--peers", "echo,schemaless,echo2,speculating", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["skipped_peers"] == {
        "schemaless": "cannot hold its output to a JSON schema: it has no structured output"}
    assert seen[1:] == SCHEMAS  # after the warm-up (no schema), each prompt's own schema
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"none", "none-fast", "ngram", "echo", "echo2", "speculating"}
    for name in ("none", "ngram", "echo", "echo2"):  # ours, and peers decoding with ours
        assert rows[name]["valid"] == 1.0, (name, rows[name])
    assert rows["speculating"]["valid"] == 0.0
    assert rows["speculating"]["valid_runs"] == [False] * 3
    assert rows["echo"]["valid_runs"] == [True] * 3  # prompt by prompt
    assert rows["speculating"]["identical_to_own_plain"] == 0.0
    assert rows["echo"]["identical_to_own_plain"] is None  # a plain peer says nothing
    # the fastest peer configuration (echo, 100 tok/s) is every row's yardstick
    assert {r["fastest_peer"] for r in rows.values()} == {"echo"}
    assert rows["echo"]["ratio_to_fastest_peer"] == 1.0
    assert rows["echo2"]["ratio_to_fastest_peer"] == 0.5
    assert rows["speculating"]["ratio_to_fastest_peer"] == 0.25
    none_runs = rows["none"]["tokens_per_s"]["runs"]
    assert rows["none"]["ratio_to_fastest_peer"] == pytest.approx(
        statistics.median(x / 100.0 for x in none_runs))
    assert "x fastest peer" in result.stdout and "(vs echo)" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("engine"))
    assert "valid" in header


def test_valid_json():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}},
              "required": ["n"], "additionalProperties": False}
    assert valid_json('{"n": 2}', schema)
    assert valid_json('{\n  "n": 3\n}', schema)  # whitespace is the writer's choice
    for text in ('{"n": 4}', '{"n": 2, "m": 1}', '{"n": 2', "", '{"n": 2} trailing'):
        assert not valid_json(text, schema), text


def test_completion_body_under_a_schema():
    """llama.cpp: the schema in the request's json_schema field, and EOS ends the answer."""
    from trt_spec.tools.peers.llamacpp import completion_body

    plain = completion_body([1, 2], 8, 0.0, 0)
    assert plain["ignore_eos"] and "json_schema" not in plain and plain["top_k"] == 1
    held = completion_body([1, 2], 8, 0.0, 0, {"type": "boolean"})
    assert held == {**plain, "ignore_eos": False, "json_schema": {"type": "boolean"}}


def test_transformers_peers_say_they_hold_no_schema():
    for name in ("transformers", "transformers-assisted"):
        ok, reason = peer_registry.PEERS[name]().holds_schemas()
        assert not ok and "no JSON-schema constraint" in reason


def test_bench_plot(fake_peers, tiny_engine, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    result = CliRunner().invoke(main, [
        "bench", "--engine", str(tiny_engine), "--prompts", str(write_prompts(tmp_path, 2)),
        "--methods", "ngram", "--num-draft-tokens", "2", "--max-new-tokens", str(N),
        "--repeats", "1", "--past", "8", "--peers", "echo", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib(tiny_engine, tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine), "--plot",
                                       str(tmp_path / "b.png")])
    assert result.exit_code != 0 and "--plot needs matplotlib" in result.output


# --- the transformers peers on the tiny model -------------------------------------------------

def test_hf_draft_equals_our_draft(tiny_hf_dir, tiny_draft, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.test_target_model import forward_full
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import load_draft
    from trt_spec.export.hf_draft import draft_to_hf

    target, _ = load_target(tiny_hf_dir)
    ours = load_draft(tiny_draft, target)
    out = draft_to_hf(tiny_hf_dir, tiny_draft, tmp_path / "hf-draft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 2
    ids = torch.randint(3, 128, (1, 19), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = forward_full(ours, ours.config, ids)[0]
        got = hf(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # built once: the same target and draft reuse the folder
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert draft_to_hf(tiny_hf_dir, tiny_draft, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def tiny_ctx(tiny_hf_dir, tmp_path, draft=None, k=3) -> PeerContext:
    return PeerContext(model=str(tiny_hf_dir), draft=str(draft) if draft else None, threads=1,
                       num_draft_tokens=k, cache=tmp_path / "cache")


def our_greedy(engine, prompt_ids, n):
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams

    gen = Generator(str(engine))
    return generate_ids(gen, [prompt_ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].output_ids


@pytest.mark.parametrize("name", ["transformers", "transformers-assisted"])
def test_transformers_peers_on_tiny(name, tiny_hf_dir, tiny_engine, tiny_draft, tmp_path):
    pytest.importorskip("transformers")
    peer = peer_registry.PEERS[name]()
    assert peer.available() == (True, "")
    peer.load(tiny_ctx(tiny_hf_dir, tmp_path, tiny_draft))
    prompt = [1, 5, 9, 40, 7]
    n = 12
    try:
        r = peer.generate(prompt, n, 0.0, 0)
        # greedy fp32: our fp32 engine's tokens (assisted generation is lossless at greedy)
        assert r["output_ids"] == our_greedy(tiny_engine, prompt, n)
        assert r["completion_tokens"] == n and r["tokens_per_s"] > 0 and r["ttft_s"] > 0
        if name == "transformers":
            assert r["target_forwards"] == n  # one forward a token
        else:
            assert peer.num_draft_tokens == 3 and 1 <= r["target_forwards"] <= n
        sampled = [peer.generate(prompt, n, 1.0, seed)["output_ids"] for seed in (1, 1, 2)]
        assert sampled[0] == sampled[1] and len(sampled[2]) == n  # seeded
    finally:
        peer.close()


def test_assisted_peer_needs_a_draft(tiny_hf_dir, tmp_path):
    pytest.importorskip("transformers")
    peer = peer_registry.PEERS["transformers-assisted"]()
    with pytest.raises(ValueError, match="no vanilla draft"):
        peer.load(tiny_ctx(tiny_hf_dir, tmp_path, None))


# --- real peers, where installed ---------------------------------------------------------------

def test_ortgenai_peer_on_tiny(tiny_hf_dir, tmp_path):
    peer = peer_registry.PEERS["onnxruntime-genai"]()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    peer.load(tiny_ctx(tiny_hf_dir, tmp_path))
    try:
        assert (tmp_path / "cache" / "ortgenai-int4" / "genai_config.json").is_file()
        r = peer.generate([1, 5, 9, 40, 7], N, 0.0, 0)
        assert r["completion_tokens"] == N == len(r["output_ids"]) == r["target_forwards"]
        assert r["tokens_per_s"] > 0 and r["ttft_s"] > 0
        assert r == {**r, "output_ids": peer.generate([1, 5, 9, 40, 7], N, 0.0, 0)["output_ids"]}
    finally:
        peer.close()


def test_ortgenai_ngram_peer_on_tiny(tiny_hf_dir, tmp_path):
    """Its own n-gram speculation: N tokens, its statistics, and whether its output equals
    its own plain output (greedy)."""
    peer = peer_registry.PEERS["onnxruntime-genai-ngram"]()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    peer.load(tiny_ctx(tiny_hf_dir, tmp_path, k=3))
    try:
        assert peer.num_draft_tokens == 3
        prompt = [1, 5, 9, 40, 7, 1, 5, 9, 40, 7, 1, 5]
        r = peer.generate(prompt, N, 0.0, 0)
        assert r["completion_tokens"] == N == len(r["output_ids"])
        assert isinstance(r["same_as_own_plain"], bool)
        assert r["target_forwards"] is None or r["target_forwards"] >= 1
        plain = peer_registry.PEERS["onnxruntime-genai"]()
        plain.load(tiny_ctx(tiny_hf_dir, tmp_path))
        want = plain.generate(prompt, N, 0.0, 0)["output_ids"]
        assert r["same_as_own_plain"] == (r["output_ids"] == want)
        assert "same_as_own_plain" not in peer.generate(prompt, N, 0.7, 1)
    finally:
        peer.close()


def test_ortgenai_draft_peer_on_tiny(tiny_hf_dir, tiny_draft, tmp_path):
    """Its draft-model speculation with our draft: the draft built by its builder, a model
    folder naming it under model.draft, N tokens at k, its statistics, and whether its
    output equals its own plain output (greedy)."""
    from trt_spec.tools.peers.ortgenai import OrtGenaiDraftPeer

    peer = OrtGenaiDraftPeer()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    with pytest.raises(ValueError, match="no vanilla draft"):
        peer.load(tiny_ctx(tiny_hf_dir, tmp_path, None))
    peer.load(tiny_ctx(tiny_hf_dir, tmp_path, tiny_draft, k=2))
    try:
        folder = tmp_path / "cache" / "ortgenai-int4-draft"
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        assert config["draft"]["filename"] == "draft/model.onnx"
        assert config["draft"]["num_hidden_layers"] == 2
        assert (folder / "draft" / "model.onnx").is_file()
        assert peer.speculative_options() == {"max_draft_tokens": 2}
        prompt = [1, 5, 9, 40, 7]
        r = peer.generate(prompt, N, 0.0, 0)
        assert r["completion_tokens"] == N == len(r["output_ids"])
        assert 1 <= r["target_forwards"] <= N and 0 <= r["acceptance_rate"] <= 1
        plain = peer_registry.PEERS["onnxruntime-genai"]()
        plain.load(tiny_ctx(tiny_hf_dir, tmp_path))
        assert r["same_as_own_plain"] == (r["output_ids"] == plain.generate(prompt, N, 0.0, 0)[
            "output_ids"])
        # a second load finds the draft built (same draft: not rebuilt)
        built = (tmp_path / "cache" / "ortgenai-draft-int4" / "model.onnx").stat().st_mtime_ns
        again = OrtGenaiDraftPeer()
        again.load(tiny_ctx(tiny_hf_dir, tmp_path, tiny_draft, k=2))
        again.close()
        assert (tmp_path / "cache" / "ortgenai-draft-int4" / "model.onnx").stat().st_mtime_ns == built
    finally:
        peer.close()


def test_ortgenai_builder_failure_says_why(tmp_path):
    """A model its builder cannot read: the error carries the builder's last line (bench
    shows it as the skip reason), and nothing half-built is left."""
    from trt_spec.tools.peers.ortgenai import build_model

    ok, reason = peer_registry.PEERS["onnxruntime-genai"]().available()
    if not ok:
        pytest.skip(reason)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(RuntimeError, match=r"builder failed \(exit \d+: \S.*\); see "):
        build_model(tmp_path / "hf", tmp_path / "out", tmp_path / "build.log")
    assert not (tmp_path / "out").exists()


def test_ortgenai_graph_scorer_follows_its_generator(tiny_hf_dir, tmp_path):
    """Teacher forcing on its graph (fidelity --onnxruntime-genai): scoring prompt + its own
    greedy answer in one forward gives, at every position, the token its generator chose."""
    from trt_spec.tools.peers.ortgenai import GraphScorer

    peer = peer_registry.PEERS["onnxruntime-genai"]()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    peer.load(tiny_ctx(tiny_hf_dir, tmp_path))
    prompt = [1, 5, 9, 40, 7]
    answer = peer.generate(prompt, N, 0.0, 0)["output_ids"]
    peer.close()
    logits = GraphScorer(tmp_path / "cache" / "ortgenai-int4", 1)(prompt + answer, len(prompt))
    assert logits.shape[0] == N  # one row per answer token, each predicting it
    assert list(logits.argmax(-1)) == answer


@pytest.mark.slow
def test_llamacpp_peer_on_smollm2(tmp_path):
    """The real GGUF through llama-server: N tokens, ids returned, the server gone after."""
    from trt_spec.export.checkpoint import KNOWN_MODELS, cache_dir
    from trt_spec.tools.peers.llamacpp import LlamaCppPeer

    peer = LlamaCppPeer()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    gguf = cache_dir() / "smollm2-135m" / KNOWN_MODELS["smollm2-135m"][1].split("/")[-1]
    if not gguf.is_file():
        pytest.skip(f"{gguf} is not cached")
    peer.load(PeerContext(model="smollm2-135m", draft=None, threads=2, num_draft_tokens=4,
                          cache=tmp_path))
    proc = peer.server.proc
    try:
        assert peer.precision == "Q4_1 GGUF"
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]
        r = peer.generate(prompt, 16, 0.0, 0)
        assert r["completion_tokens"] == 16 == len(r["output_ids"])
        assert r["tokens_per_s"] > 0 and r["target_forwards"] is None
        assert peer.generate(prompt, 16, 0.0, 0)["output_ids"] == r["output_ids"]  # greedy
        held = peer.generate(small_schema_prompt(), 64, 0.0, 0, SMALL_SCHEMA)  # ends at EOS
        assert held["completion_tokens"] < 64 and held["output_ids"][-1] == 2
        assert valid_json(smollm2_decode(held["output_ids"]), SMALL_SCHEMA)
    finally:
        peer.close()
    assert proc.poll() is not None


SMALL_SCHEMA = {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"], "additionalProperties": False}


def smollm2_tokenizer():
    from trt_spec.export.checkpoint import resolve_model
    from trt_spec.runtime.tokenizer import Tokenizer

    return Tokenizer(resolve_model("smollm2-135m"))


def smollm2_decode(ids: list[int]) -> str:
    return smollm2_tokenizer().decode(ids)


def small_schema_prompt() -> list[int]:
    """A chat turn in SmolLM2's format (its HF folder carries no template)."""
    return smollm2_tokenizer().encode(
        "<|im_start|>user\nPick a color (red, green or blue) and a count from 0 to 9. Answer "
        "in JSON.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onnxruntime-genai", "onnxruntime-genai-ngram"])
def test_ortgenai_peers_under_a_schema_on_smollm2(name):
    """Its guidance on the real model (the tiny word-level tokenizer is one its guidance
    cannot read): the answer is JSON the schema accepts and ends with it, before the cap; its
    n-gram speculation says whether it equals its plain output under the same schema."""
    from trt_spec.runtime.files import cache_dir

    peer = peer_registry.PEERS[name]()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    peer.load(PeerContext(model="smollm2-135m", draft=None, threads=2, num_draft_tokens=4,
                          cache=cache_dir() / "smollm2-135m"))
    try:
        assert peer.holds_schemas() == (True, "")
        r = peer.generate(small_schema_prompt(), 64, 0.0, 0, SMALL_SCHEMA)
        assert 0 < r["completion_tokens"] < 64 and r["tokens_per_s"] > 0
        assert valid_json(smollm2_decode(r["output_ids"]), SMALL_SCHEMA), r["output_ids"]
        if name.endswith("ngram"):
            assert isinstance(r["same_as_own_plain"], bool) and r["target_forwards"] is None
        else:  # forced tokens come without a forward of their own
            assert r["target_forwards"] <= r["completion_tokens"]
    finally:
        peer.close()


def test_prepare_reports_what_it_cannot_build(tiny_engine, tmp_path, monkeypatch):
    """`python -m trt_spec.tools.peers`: the tiny engine has no vanilla draft; the
    onnxruntime-genai model is built (or the reason it is not) into the cache."""
    from trt_spec.tools.peers.__main__ import prepare

    monkeypatch.setenv("TRT_SPEC_CACHE", str(tmp_path))
    done = prepare(str(tiny_engine))
    assert done["transformers-assisted"] == ("not prepared: ValueError: the engine has no "
                                             "vanilla draft")
    ok, reason = peer_registry.PEERS["onnxruntime-genai"]().available()
    assert done["onnxruntime-genai"].endswith("ortgenai-int4") if ok else (
        done["onnxruntime-genai"] == f"not prepared: {reason}")
    for name in ("onnxruntime-genai-draft", "llama.cpp-draft"):  # both need the draft
        ok, reason = peer_registry.PEERS[name]().available()
        assert done[name] == ("not prepared: ValueError: the engine has no vanilla draft"
                              if ok else f"not prepared: {reason}")
