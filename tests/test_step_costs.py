"""`trt-spec bench --step-costs`: the c(T) curve is measured for every T and past, the slot
comes back, and bad pasts are refused."""

import json

from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.runtime.generator import Generator
from trt_spec.tools.step_costs import step_costs


def test_step_costs_cover_every_t_and_past(tiny_engine):
    gen = Generator(tiny_engine, max_len=128)
    result = step_costs(gen, [8, 40], list(range(1, 10)), repeats=2, warmup=1)
    assert set(result["ms"]) == {8, 40}
    for past in (8, 40):
        assert list(result["ms"][past]) == list(range(1, 10))
        assert all(v > 0 for v in result["ms"][past].values())
        assert result["ratio"][past][1] == 1.0
    assert gen.cache.free_slots == gen.cache.slots  # the measuring slot was released


def test_step_costs_cli(tiny_engine, tmp_path):
    out = tmp_path / "c.json"
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine), "--step-costs",
                                       "--past", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "c(T)/c(1)" in result.output
    assert set(json.loads(out.read_text())["ms"]["16"]) == {str(t) for t in range(1, 10)}
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine), "--step-costs",
                                       "--past", "0"])
    assert result.exit_code != 0 and "past 0" in result.output
