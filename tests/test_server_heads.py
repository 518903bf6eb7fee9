"""Per-request head drafters over HTTP: `speculative.method` mtp / eagle / eagle3 on an engine
folder that has them (random heads) gives the plain greedy text, and counts its drafts."""

import openai
import pytest

from tests.server_util import start_server

EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_heads_engine):
    # every step drafts its k: under the gain rules a cost probe timed on a loaded machine
    # can price the random heads' drafts out of a 16-token request (none proposed)
    s = start_server(tiny_heads_engine, "--max-num-seqs", "3", "--no-spec-fallback")
    yield s
    assert s.stop() == 0


def test_head_methods_per_request(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].model_extra["methods"] == \
        ["none", "ngram", "suffix", "mtp", "eagle", "eagle3", "hybrid", "auto"]
    kw = dict(model="tiny", prompt="a b c d", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw, extra_body=EXTRA)
    for method, k in (("mtp", 3), ("eagle", 2), ("eagle3", 4)):
        out = client.completions.create(**kw, extra_body={
            **EXTRA, "speculative": {"method": method, "num_draft_tokens": k}})
        assert out.choices[0].text == plain.choices[0].text, method
        m = out.model_extra["metrics"]
        assert m["method"] == method and m["proposed_tokens"] > 0
