"""The OpenVINO GenAI peers (tools/peers/openvino.py) against a stand-in `openvino_genai`: what
they hand its pipeline (our prompt ids, threads, EOS ignored or a schema, prompt lookup's k)
and what they make of its answer (stamps per streamed chunk, its own plain output), so the
plumbing is tested where OpenVINO is not installed. The real one runs in `make bench-peers`."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import numpy as np
import pytest

from trt_spec.tools import peers as peer_registry
from trt_spec.tools.peers import PeerContext

ANSWER = [7, 8, 9, 10, 11, 2]  # 2: the stand-in's EOS


def fake_modules(structured: bool = True) -> tuple[types.ModuleType, types.ModuleType, list]:
    """(openvino_genai, openvino, the pipelines it opened). A pipeline streams ANSWER (in
    chunks of 2 with prompt lookup), less its EOS where EOS is ignored."""
    genai, ov = types.ModuleType("openvino_genai"), types.ModuleType("openvino")
    for m in (genai, ov):
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    genai.__version__ = "2026.4.1-stand-in"
    opened = []

    class GenerationConfig:
        def __init__(self, **kwargs):
            self.structured_output_config = None
            self.num_assistant_tokens = self.max_ngram_size = 0
            self.__dict__.update(kwargs)

    class StructuredOutputConfig:
        def __init__(self, json_schema: str):
            self.json_schema = json_schema

    class StreamerBase:
        pass

    class Pipeline:
        def __init__(self, path, device, **properties):
            self.path, self.device, self.properties, self.calls = path, device, properties, []
            opened.append(self)

        def generate(self, inputs, config, streamer):
            self.calls.append((inputs, config))
            answer = ANSWER[:-1] if config.ignore_eos else ANSWER
            step = 2 if self.properties.get("prompt_lookup") else 1
            for i in range(0, len(answer), step):
                chunk = answer[i:i + step]
                streamer.write(chunk if step > 1 else chunk[0])
            streamer.end()
            return types.SimpleNamespace(tokens=[list(answer)])

    genai.GenerationConfig, genai.StreamerBase, genai.LLMPipeline = (GenerationConfig,
                                                                     StreamerBase, Pipeline)
    genai.StreamingStatus = types.SimpleNamespace(RUNNING=0)
    genai.TokenizedInputs = lambda ids, mask: types.SimpleNamespace(input_ids=ids, mask=mask)
    if structured:
        genai.StructuredOutputConfig = StructuredOutputConfig
    ov.Tensor = np.asarray
    return genai, ov, opened


@pytest.fixture
def openvino(monkeypatch):
    genai, ov, opened = fake_modules()
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", ov)
    return opened


def ctx(tmp_path, k: int = 3) -> PeerContext:
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    return PeerContext(model=str(gguf), draft=None, threads=2, num_draft_tokens=k,
                       cache=tmp_path / "cache")


def test_openvino_peers_are_registered():
    assert {"openvino", "openvino-lookup"} <= set(peer_registry.PEERS)
    assert peer_registry.peer_ks(peer_registry.PEERS["openvino-lookup"], [2, 4]) == [2, 4]
    assert peer_registry.peer_ks(peer_registry.PEERS["openvino"], [2, 4]) == [None]


def test_openvino_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openvino_genai" else real(name, *a))
    ok, reason = peer_registry.PEERS["openvino"]().available()
    assert not ok and "pip install -e '.[bench]'" in reason


def test_openvino_plain_and_under_a_schema(openvino, tmp_path):
    peer = peer_registry.PEERS["openvino"]()
    assert peer.available() == (True, "")
    peer.load(ctx(tmp_path))
    (pipe,) = openvino
    assert pipe.device == "CPU" and pipe.properties == {"INFERENCE_NUM_THREADS": 2}
    assert pipe.path.endswith(".Q4_1.gguf") and peer.precision == "Q4_1 GGUF (OpenVINO)"
    assert "OpenVINO GenAI 2026.4.1-stand-in" in peer.engine
    assert peer.holds_schemas() == (True, "")
    prompt = [1, 5, 9]
    r = peer.generate(prompt, 5, 0.0, 0)
    inputs, config = pipe.calls[-1]
    assert inputs.input_ids.tolist() == [prompt] and inputs.mask.tolist() == [[1, 1, 1]]
    assert config.ignore_eos and config.max_new_tokens == 5 and not config.do_sample
    assert config.structured_output_config is None
    assert r["output_ids"] == ANSWER[:-1] and r["completion_tokens"] == 5
    assert r["target_forwards"] == 5 and r["tokens_per_s"] > 0 and r["ttft_s"] > 0
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = peer.generate(prompt, 64, 0.0, 0, schema)
    _, config = pipe.calls[-1]
    assert not config.ignore_eos and config.max_new_tokens == 64  # EOS ends the JSON
    assert json.loads(config.structured_output_config.json_schema) == schema
    assert r["output_ids"] == ANSWER and "same_as_own_plain" not in r
    sampled = peer.generate(prompt, 5, 0.7, 11)
    _, config = pipe.calls[-1]
    assert config.do_sample and config.temperature == 0.7 and config.rng_seed == 11
    assert config.top_p == 1.0 and "top_k" not in vars(config)  # its top_k is off by default
    assert sampled["completion_tokens"] == 5
    peer.close()
    assert peer.pipe is None


def test_openvino_lookup_compares_with_its_own_plain_output(openvino, tmp_path):
    peer = peer_registry.PEERS["openvino-lookup"]()
    peer.load(ctx(tmp_path, k=4))
    assert peer.num_draft_tokens == 4 and "prompt lookup (n-gram 3, k = 4)" in peer.engine
    (pipe,) = openvino
    assert pipe.properties == {"INFERENCE_NUM_THREADS": 2, "prompt_lookup": True}
    schema = {"type": "boolean"}
    for _ in range(2):
        r = peer.generate([1, 5, 9], 64, 0.0, 0, schema)
        assert r["same_as_own_plain"] is True and r["untimed_s"] >= 0
    _, config = pipe.calls[-1]
    assert config.num_assistant_tokens == 4 and config.max_ngram_size == 3
    # the plain pipeline: opened once, without prompt lookup, asked once per prompt and schema
    assert len(openvino) == 2 and openvino[1].properties == {"INFERENCE_NUM_THREADS": 2}
    assert len(openvino[1].calls) == 1
    plain_config = openvino[1].calls[0][1]
    assert plain_config.num_assistant_tokens == 0
    assert json.loads(plain_config.structured_output_config.json_schema) == schema
    # chunks of two tokens, each token stamped with its chunk
    assert r["completion_tokens"] == 6 and r["target_forwards"] is None
    assert "same_as_own_plain" not in peer.generate([1, 5, 9], 5, 0.7, 1)
    peer.close()


def test_openvino_without_structured_output(monkeypatch, tmp_path):
    genai, ov, _ = fake_modules(structured=False)
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", ov)
    peer = peer_registry.PEERS["openvino"]()
    peer.load(ctx(tmp_path))
    ok, reason = peer.holds_schemas()
    assert not ok and "has no structured output (StructuredOutputConfig)" in reason
