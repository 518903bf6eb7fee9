"""Structured outputs on SmolLM2 int4 with its shipped drafters: JSON shaped like real API
payloads (tests/data/schemas.jsonl) parses and validates on every method, greedy output is
the same with and without speculation and with and without grammar-forced drafts, and the
official openai client's response_format works end to end, streamed and not."""

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.server_util import start_server
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids

pytestmark = pytest.mark.slow

SCHEMAS = [json.loads(line) for line in
           (Path(__file__).parent / "data/schemas.jsonl").read_text().splitlines()]
# a sample of the set in CI (every schema: `trt-spec bench --prompts tests/data/schemas.jsonl`)
SAMPLE = ["order", "weather", "support_ticket", "api_error", "contacts", "stock_quote"]
METHODS = ["none", "ngram", "hybrid", "eagle3", "mtp"]


def test_the_schema_set_is_shaped_like_api_payloads():
    assert len(SCHEMAS) >= 20
    text = json.dumps([s["json_schema"] for s in SCHEMAS])
    for feature in ('"enum"', '"pattern"', '"type": "array"', '"type": "number"',
                    '"type": "boolean"', '"type": "integer"'):
        assert feature in text, feature
    nested = [s for s in SCHEMAS if any(p.get("type") == "object" for p in
                                        s["json_schema"]["properties"].values())]
    optional = [s for s in SCHEMAS if set(s["json_schema"]["properties"])
                - set(s["json_schema"]["required"])]
    assert len(nested) >= 3 and len(optional) >= 3
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s["json_schema"])


@pytest.fixture(scope="module")
def gen(smollm2_int4_spec_engine):
    return Generator(smollm2_int4_spec_engine, max_len=1024)


@pytest.mark.parametrize("name", SAMPLE)
def test_json_validates_on_every_method_and_greedy_output_is_the_same(gen, name):
    case = next(s for s in SCHEMAS if s["name"] == name)
    params = SamplingParams(max_tokens=512, json_schema=case["json_schema"])
    prompt = gen.encode(case["messages"])
    outputs = {}
    for method in METHODS:
        s = generate_ids(gen, [prompt], params, method, None if method == "none" else 4)[0]
        assert s.finish_reason == "stop", (method, s.text)
        jsonschema.validate(json.loads(s.text), case["json_schema"])
        outputs[method] = s.output_ids
    assert all(o == outputs["none"] for o in outputs.values()), name


def test_a_sampled_answer_validates_too(gen):
    case = next(s for s in SCHEMAS if s["name"] == "user_profile")
    for method, seed in [("none", 1), ("eagle3", 2), ("hybrid", 3)]:
        params = SamplingParams(max_tokens=512, json_schema=case["json_schema"],
                                temperature=0.8, seed=seed)
        s = generate_ids(gen, [gen.encode(case["messages"])], params, method,
                             None if method == "none" else 4)[0]
        assert s.finish_reason == "stop", s.text
        jsonschema.validate(json.loads(s.text), case["json_schema"])


def test_an_answer_cut_by_max_tokens_says_length(gen):
    case = next(s for s in SCHEMAS if s["name"] == "recipe")
    s = generate_ids(gen, [gen.encode(case["messages"])],
                         SamplingParams(max_tokens=12, json_schema=case["json_schema"]))[0]
    assert s.finish_reason == "length" and len(s.output_ids) == 12


@pytest.fixture(scope="module")
def client(smollm2_int4_spec_engine):
    server = start_server(smollm2_int4_spec_engine, "--max-num-seqs", "2", model="smollm2",
                          timeout=120)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert server.stop() == 0


def test_openai_response_format_end_to_end(client):
    case = next(s for s in SCHEMAS if s["name"] == "flight")
    fmt = {"type": "json_schema",
           "json_schema": {"name": "flight", "schema": case["json_schema"], "strict": True}}
    kw = dict(model="smollm2", messages=case["messages"], max_tokens=512, temperature=0,
              response_format=fmt)
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), case["json_schema"])
    assert whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == text
    # json_object: any JSON object; on completions too
    obj = client.completions.create(model="smollm2", prompt="A JSON object describing a cat:",
                                    max_tokens=200, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_a_bad_response_format_is_a_400_naming_it(client):
    for fmt, reason in [({"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "nope"}}},
                         "does not compile"),
                        ({"type": "xml"}, "expected"),
                        ({"type": "json_schema"}, "json_schema")]:
        with pytest.raises(openai.BadRequestError, match=reason) as e:
            client.chat.completions.create(model="smollm2", max_tokens=8,
                                           messages=[{"role": "user", "content": "hi"}],
                                           response_format=fmt)
        assert e.value.body["param"] == "response_format"
