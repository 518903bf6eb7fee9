"""lm-evaluation-harness against `trt-spec serve` (scripts/eval_harness.py, `make eval`): its
multiple-choice task through local-completions (echo + logprobs, token-id prompts batched per
request) and its generation task through local-chat-completions, on int4 SmolLM2, beside the
same multiple-choice items on the fp32 checkpoint in transformers (lm_eval's `hf` model).
The first LIMIT items of each task keep it to a few minutes; `make eval` runs them all."""

import pytest

from tests.script_util import load_script

LIMIT = 60


@pytest.mark.slow
def test_lm_eval_scores_the_served_engine_as_transformers(smollm2_int4_spec_engine, tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    import json

    harness = load_script("eval_harness")
    out = tmp_path / "eval.json"
    assert harness.main(["--engine", str(smollm2_int4_spec_engine), "--limit", str(LIMIT),
                         "--threads", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["refused"] == 0  # no request refused, none failed
    mc = report["mc"]
    assert mc["served"]["items"] == mc["transformers_fp32"]["items"] == LIMIT
    assert abs(mc["acc_difference_points"]) <= 2.0, mc
    # greedy answers are the same with speculation as without (lossless)
    assert report["generation"]["identical"] == report["generation"]["items"] == 20
