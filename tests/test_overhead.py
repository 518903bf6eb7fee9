"""`trt-spec bench --overhead`: one target forward split into its parts; the parts add up to
the measured total, the slot comes back, and what it cannot split is refused."""

import json

from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.runtime.generator import Generator
from trt_spec.tools.overhead import PARTS, decompose, layers


def test_layers_are_the_graph_and_what_the_runtime_adds(tiny_engine):
    gen = Generator(tiny_engine, max_len=128)
    parts = layers(gen, 16, 3, repeats=3)
    assert set(parts) == {"graph", "binding", "inputs"}
    assert parts["graph"] > 0
    assert gen.cache.free_slots == gen.cache.slots  # the measuring slot was released


def test_decompose_adds_up_to_the_generation_it_measured(tiny_engine):
    gen = Generator(tiny_engine, max_len=128, method="ngram", num_draft_tokens=2,
                    fallback=False, prefix_cache=False)
    row = decompose(gen, 16, "ngram", 2, max_tokens=12, repeats=3, runs=1)
    total = row["sample"] + row["propose"] + row["loop"] + row["score"]
    assert abs(total - row["total"]) < 1e-9
    assert row["propose"] > 0 and row["tau"] >= 1.0
    assert row["per_token"] <= row["total"]
    assert set(PARTS) <= set(row)


def test_overhead_cli(tiny_spec_engine, tmp_path):
    out = tmp_path / "o.json"
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_spec_engine), "--overhead",
                                       "--past", "16", "--max-new-tokens", "8",
                                       "--methods", "none,vanilla", "--num-draft-tokens", "2",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "ms per target forward" in result.output
    report = json.loads(out.read_text())["16"]
    assert list(report) == ["none, exact", "none, fast", "vanilla k=2, exact"]
    # the draft model's forwards happen in the propose phase
    assert report["vanilla k=2, exact"]["propose"] > report["none, exact"]["propose"]
    for options, message in [(["--num-draft-tokens", "auto"], "one fixed k"),
                             (["--step-costs"], "give one")]:
        result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_spec_engine),
                                           "--overhead", "--past", "16", *options])
        assert result.exit_code != 0 and message in result.output, result.output
