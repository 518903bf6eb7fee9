"""ExportConfig (export/config.py): `trt-spec export`'s settings, validated once, with the
drafters keyed by the registry's methods."""

from pathlib import Path

import pytest

from trt_spec.export.config import DRAFTER_METHODS, ExportConfig


def test_defaults_follow_the_runtime_lowered_for():
    c = ExportConfig("smollm2-135m")
    assert (c.precision, c.lower_for, c.out) == ("int4", "ort", Path("engines/smollm2-135m"))
    assert c.shipped_drafters and c.drafters == {} and c.draft_vocab is None
    assert ExportConfig("m", lower_for="trt").precision == "fp16"
    assert ExportConfig("models/q.gguf").out == Path("engines/q")


def test_drafters_are_keyed_by_method_in_the_order_given():
    c = ExportConfig("m", drafters={"eagle3": Path("h/e3"), "vanilla": "d", "mtp": None,
                                    "eagle": ""})
    assert c.drafters == {"eagle3": "h/e3", "vanilla": "d"}  # paths as strings, unnamed left out
    assert list(c.drafters) == ["eagle3", "vanilla"]
    assert c.heads == {"eagle3": "h/e3"} and c.draft_model == "d"
    assert DRAFTER_METHODS == ("vanilla", "mtp", "eagle", "eagle3")


@pytest.mark.parametrize("kwargs,words", [
    ({"drafters": {"ngram": "x"}}, "drafters ['ngram'] are not known; known: vanilla, mtp"),
    ({"precision": "fp16"}, "precision 'fp16' is not supported when lowering for ort"),
    ({"lower_for": "tensorrt"}, "lower_for='tensorrt': expected one of ort, trt"),
    ({"draft_layers": -1}, "draft_layers=-1: must be an integer >= 0"),
    ({"draft_layers": True}, "draft_layers=True: must be an integer >= 0"),
    ({"draft_layers": 2, "drafters": {"vanilla": "d"}}, "give either --draft-layers"),
    ({"draft_vocab": "4096"}, "--draft-vocab '4096': a draft vocabulary of N tokens"),
    ({"draft_vocab": "top-8k"}, "--draft-vocab 'top-8k': expected one of eagle3, none"),
    ({"shipped_drafters": "yes"}, "shipped_drafters='yes': expected True or False"),
    ({"model": ""}, "model='': expected a model name"),
])
def test_bad_values_are_refused_quoting_them(kwargs, words):
    kwargs = {"model": "m", **kwargs}
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ExportConfig(**kwargs)


def test_shipped_drafters_fill_in_what_the_config_leaves_out():
    """A known model's shipped drafters join in the registry's order; a drafter the config
    names (or --draft-layers, for the vanilla draft) wins."""
    pytest.importorskip("torch")
    from trt_spec.export.checkpoint import shipped_drafters
    from trt_spec.export.pipeline import with_shipped_drafters

    shipped = shipped_drafters("smollm2-135m")
    if set(shipped) != {"draft", "mtp", "eagle", "eagle3"}:
        pytest.skip(f"the repository's drafters/smollm2-135m/ holds {sorted(shipped)}")
    c = with_shipped_drafters(ExportConfig("smollm2-135m", drafters={"eagle3": "mine"},
                                           draft_layers=2))
    assert list(c.drafters) == ["mtp", "eagle", "eagle3"] and c.drafters["eagle3"] == "mine"
    assert c.drafters["mtp"] == str(shipped["mtp"])
    c = with_shipped_drafters(ExportConfig("smollm2-135m"))
    assert c.draft_model == str(shipped["draft"])
    tiny = ExportConfig("models/tiny", drafters={"eagle3": "a", "mtp": "b"})
    assert with_shipped_drafters(tiny) is tiny  # no shipped drafters: as given, in its order
