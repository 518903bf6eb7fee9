"""What vLLM's server accepts, `trt-spec serve` accepts: every field of vLLM's chat and
completions request models is implemented, or accepted and ignored with a logged note, or
(where this server cannot act on it) a 400 saying why; each has its row in docs/serving.md's
request-field table. And the implemented ones do what vLLM's do, on the tiny model (greedy).
(The sampling masks' speculative exactness: tests/test_sampling_controls.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.server_util import start_server
from trt_spec.serve.protocol import IGNORED, REFUSED

# vLLM's ChatCompletionRequest, field by field (vllm/entrypoints/openai/chat_completion/
# protocol.py, and the guided_* fields of its earlier protocol.py), each with a value a
# client sends that is not the default
VLLM_CHAT = {
    "messages": [{"role": "user", "content": "a b"}], "model": "tiny",
    "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "logprobs": True, "top_logprobs": 2,
    "max_tokens": 2, "max_completion_tokens": 2, "n": 2, "presence_penalty": 0.5,
    "response_format": {"type": "text"}, "seed": 1, "stop": ["zz"], "stream": False,
    "stream_options": None, "temperature": 0.5, "top_p": 0.9,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none", "reasoning_effort": "low", "thinking_token_budget": 10,
    "include_reasoning": False, "parallel_tool_calls": False, "user": "u",
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
    "watermarking": True, "length_penalty": 1.5, "stop_token_ids": [7],
    "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1,
    "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4, "truncation_side": "left", "prompt_logprobs": 1,
    "logprob_token_ids": [5], "allowed_token_ids": [5, 6, 7], "bad_words": ["c"],
    "echo": True, "add_generation_prompt": False, "continue_final_message": False,
    "add_special_tokens": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"x": 1},
    "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1},
    "structured_outputs": {"choice": ["a", "b"]}, "priority": 1, "request_id": "r1",
    "session_id": "s1", "return_tokens_as_token_ids": True, "return_token_ids": True,
    "routed_experts_prompt_start": 1, "return_token_offsets": True,
    "return_prompt_text": True, "return_mm_kwargs": False, "cache_salt": "salt",
    "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4}, "stream_interval": 2,
    "guided_json": {"type": "object"}, "guided_regex": "a", "guided_choice": ["a"],
    "guided_grammar": "start: \"a\"", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "logits_processors": ["x.y"],
}
# vLLM's CompletionRequest, the fields chat does not have
VLLM_COMPLETION = {
    "prompt": "a b", "echo": True, "logprobs": 2, "suffix": "x", "best_of": 2,
    "prompt_embeds": "AAAA",
}
STRUCTURES = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs", "response_format")
# fields that are a 400 here, and why (the docs' "refused" rows): set up by REFUSED in
# serve/protocol.py, or unknown (OpenAI's suffix and best_of, which vLLM refuses too)
REFUSED_HERE = {**{k: k for k in REFUSED}, "suffix": "suffix", "best_of": "best_of"}
DOCS = Path(__file__).parent.parent / "docs" / "serving.md"


def table_status() -> dict[str, set[str]]:
    """docs/serving.md's request-field table: field name -> its statuses (a field may have
    a row per route)."""
    text = DOCS.read_text()
    table = text[text.index("## Request fields"):text.index("## Tokenizer routes")]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                out.setdefault(name, set()).add(cells[2])
    return out


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-fields") / "server.log"
    with open(log, "w") as f:
        s = start_server(tiny_engine, "--max-model-len", "64", "--max-num-seqs", "4",
                         stderr=f)
    s.log = log
    yield s
    assert s.stop() == 0
    assert "Traceback" not in log.read_text()


def post(server, route="chat/completions", **body):
    base = ({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a b"}]}
            if route == "chat/completions" else {"model": "tiny", "max_tokens": 2,
                                                 "prompt": "a b"})
    return httpx.post(f"{server.url}/v1/{route}", json={**base, **body}, timeout=60)


def test_every_field_of_vllms_request_models_is_implemented_ignored_or_refused(server):
    """Each field alone (a structure alone too): a 200, or the 400 of a refused field naming
    it; its docs row says which; an ignored one is logged once, saying why."""
    docs = table_status()
    for route, fields in (("chat/completions", VLLM_CHAT), ("completions", VLLM_COMPLETION)):
        for name, value in fields.items():
            body = {name: value, **({"logprobs": True} if name == "top_logprobs" else {})}
            r = post(server, route, **body)
            if name in REFUSED_HERE:
                assert r.status_code == 400, (name, r.text)
                assert r.json()["error"]["param"] == name, (name, r.json())
                assert docs.get(name) == {"refused"}, name
                continue
            if name == "guided_json":  # read and compiled: the tiny word-level vocabulary
                # has no "{", so no output can follow it (a 400 naming the field)
                assert r.status_code == 400 and "no text matches" in r.text, r.text
                assert r.json()["error"]["param"] == name
                continue
            assert r.status_code == 200, (route, name, r.text)
            ignored = name in IGNORED and not (route == "completions"
                                               and name == "add_special_tokens")
            assert ("ignored" if ignored else "accepted") in docs.get(name, ()), name
    log = server.log.read_text()
    for name in IGNORED:
        if name in VLLM_CHAT:
            assert f"request field {name!r} is accepted and ignored: {IGNORED[name]}" in log
    assert post(server, no_such_field=1).status_code == 400  # a field no server defines


def test_use_beam_search_false_and_reasoning_efforts(server):
    assert post(server, use_beam_search=False).status_code == 200
    r = post(server, use_beam_search=True)
    assert r.status_code == 400 and "beam" in r.json()["error"]["message"]
    assert post(server, reasoning_effort="none").status_code == 200
    r = post(server, reasoning_effort="huge")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def ids_of(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def complete(server, **body) -> dict:
    r = post(server, "completions", **{"temperature": 0, "max_tokens": 10, "ignore_eos": True,
                                       **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_min_tokens_and_include_stop_str(server):
    base = complete(server)["choices"][0]["text"].split()
    assert len(base) == 10
    third = ids_of(server, base[2])[0]
    cut = complete(server, stop_token_ids=[third])["choices"][0]
    # the stop token ends the output; a special-free text shows the word itself
    assert cut["finish_reason"] == "stop" and cut["text"].split()[-1] == base[2] \
        and len(cut["text"].split()) == base.index(base[2]) + 1
    # min_tokens: no end token before 10 tokens (the stop id is held back; EOS too)
    held = complete(server, stop_token_ids=[third], min_tokens=10, ignore_eos=False)
    assert held["usage"]["completion_tokens"] == 10
    assert third not in ids_of(server, held["choices"][0]["text"])
    # a stop string: cut off (OpenAI's), or kept (include_stop_str_in_output)
    text = complete(server)["choices"][0]["text"]
    stop = " " + base[3]
    at = text.find(stop)
    off = complete(server, stop=[stop])["choices"][0]["text"]
    on = complete(server, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert off == text[:at] and on == text[:at + len(stop)]
    streamed = stream_text(server, "completions", stop=[stop], include_stop_str_in_output=True,
                           temperature=0, max_tokens=10, ignore_eos=True)
    assert streamed == on
    # min_tokens past the stop string's place: it stops only at a later one, or not at all
    late = complete(server, stop=[stop], include_stop_str_in_output=True,
                    min_tokens=len(on.split()) + 1)["choices"][0]["text"]
    assert late.startswith(on) and len(late) > len(on)


def stream_text(server, route, **body) -> str:
    base = {"model": "tiny", "prompt": "a b"} if route == "completions" else \
        {"model": "tiny", "messages": [{"role": "user", "content": "a b"}]}
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/{route}",
                      json={**base, **body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    text += c.get("text") or c.get("delta", {}).get("content") or ""
    return text


def test_allowed_token_ids_and_bad_words(server):
    base = complete(server)["choices"][0]["text"].split()
    allowed = ids_of(server, "c d e")
    only = complete(server, allowed_token_ids=allowed)["choices"][0]["text"].split()
    assert set(only) <= {"c", "d", "e"} and len(only) == 10
    banned = complete(server, bad_words=[base[0]])["choices"][0]["text"].split()
    assert base[0] not in banned and banned != base
    r = post(server, "completions", allowed_token_ids=[10**6])
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    r = post(server, "completions", bad_words=[""])
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_skip_special_tokens(server):
    eos = ids_of(server, "</s>")
    assert len(eos) == 1
    body = dict(logit_bias={str(eos[0]): 100}, max_tokens=3)
    assert complete(server, **body)["choices"][0]["text"] == ""
    kept = complete(server, skip_special_tokens=False, **body)["choices"][0]["text"]
    assert kept.split() == ["</s>"] * 3


def chat(server, **body) -> dict:
    r = post(server, **{"temperature": 0, "max_tokens": 3, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_prompt_fields(server):
    messages = [{"role": "user", "content": "a b c d e f"}]
    whole = chat(server, messages=messages)["usage"]["prompt_tokens"]
    assert chat(server, messages=messages, truncate_prompt_tokens=4)["usage"][
        "prompt_tokens"] == 4
    assert chat(server, messages=messages, truncate_prompt_tokens=-1)["usage"][
        "prompt_tokens"] == whole
    r = post(server, "completions", prompt="a b c d", truncate_prompt_tokens=2,
             truncation_side="right", echo=True, max_tokens=0, add_special_tokens=False)
    assert r.json()["choices"][0]["text"] == "a b" and r.json()["usage"]["prompt_tokens"] == 2
    # add_generation_prompt false: no "<|im_start|> assistant" at the end
    assert chat(server, messages=messages, add_generation_prompt=False)["usage"][
        "prompt_tokens"] == whole - 2
    # continue_final_message: the assistant's message left open; echo puts it in front
    prefill = [*messages, {"role": "assistant", "content": "x y"}]
    opened = chat(server, messages=prefill, continue_final_message=True,
                  add_generation_prompt=False)
    assert opened["usage"]["prompt_tokens"] == whole + 2  # "x y", no <|im_end|>
    echoed = chat(server, messages=prefill, continue_final_message=True,
                  add_generation_prompt=False, echo=True)
    content = echoed["choices"][0]["message"]["content"]
    assert content == "x y" + opened["choices"][0]["message"]["content"]
    streamed = stream_text(server, "chat/completions", messages=prefill, echo=True,
                           continue_final_message=True, add_generation_prompt=False,
                           temperature=0, max_tokens=3, ignore_eos=True)
    assert streamed == content
    r = post(server, messages=prefill, continue_final_message=True, add_generation_prompt=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_top_k_and_structured_outputs_on_chat(server):
    greedy = chat(server)["choices"][0]["message"]["content"]
    assert chat(server, temperature=1.0, top_k=1, seed=3)["choices"][0]["message"][
        "content"] == greedy
    assert chat(server, top_k=-1)["choices"][0]["message"]["content"] == greedy  # vLLM's off
    answer = chat(server, structured_outputs={"choice": ["q", "s"]}, max_tokens=8)
    assert answer["choices"][0]["message"]["content"] in ("q", "s")
    r = post(server, structured_outputs={"choice": ["a"]}, guided_regex="a")
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    r = post(server, structured_outputs={"nope": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


def test_include_reasoning_false_leaves_the_reasoning_out():
    from types import SimpleNamespace

    from dataclasses import replace

    from trt_spec.runtime.chat import PLAIN
    from trt_spec.serve.chat import ChatShape

    def out(text, finish=None):
        return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)

    shape = ChatShape(None, False, replace(PLAIN, think=False))
    shape.with_reasoning = False
    deltas = [shape.delta(None, out(t))["delta"] for t in ["<think> a </th", "ink> b", ""]]
    assert deltas == [{}, {"content": "b"}, {}]
    whole = shape.whole(SimpleNamespace(stream=SimpleNamespace(
        text="<think> a </think> b", logprobs=[], finish_reason="stop")))
    assert whole["message"] == {"role": "assistant", "content": "b", "reasoning_content": None}
