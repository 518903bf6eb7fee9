"""The TensorRT path without TensorRT: engine-build plans (profiles, shapes, plugins) as pure
functions, the manifest update, `trt-spec build` failing with one clear line, and the trt
backend's pure parts (profile choice, buffer shapes). Both modules import without tensorrt."""

import json
import shutil

import pytest
from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.export.trt_build import (GraphPlan, Profile, build_plan, graph_precision,
                                       input_profile, plugin_list, record_engines,
                                       symbol_ranges)
from trt_spec.runtime.backends.buckets import Bucket
from trt_spec.runtime.backends.trt import buffer_shapes, choose_profile, resolve_shape
from trt_spec.runtime.manifest import Manifest, load_manifest

RANGES = symbol_ranges(max_batch=8, max_draft_tokens=4, max_len=256, max_prefill=200)


def test_symbol_ranges():
    assert RANGES["decode"] == {"batch": (1, 8, 8), "new_tokens": (1, 5, 5),
                                "num_logits": (1, 5, 5), "max_len": (256, 256, 256)}
    assert RANGES["prefill"]["new_tokens"] == (1, 128, 200)
    assert RANGES["prefill"]["batch"] == (1, 1, 8)
    with pytest.raises(ValueError, match="max_draft_tokens >= 1"):
        symbol_ranges(8, 0, 256, 8)


@pytest.mark.parametrize("shape,want", [
    (["batch", "new_tokens"], ((1, 1), (8, 5), (8, 5))),
    (["batch", 2, "max_len", 16], ((1, 2, 256, 16), (8, 2, 256, 16), (8, 2, 256, 16))),
    ([], ((), (), ())),
])
def test_input_profile(shape, want):
    assert input_profile("x", shape, RANGES["decode"]) == want


def test_unknown_symbol_is_refused():
    with pytest.raises(ValueError, match="'seq'"):
        input_profile("x", ["batch", "seq"], RANGES["decode"])


def test_plugin_list_merges_in_order():
    entry = {"plugins": {"libraries": ["a.so"], "python_modules": ["m1"]}}
    assert plugin_list(entry, ["b.so", "a.so"], ["m1", "m2"]) == {
        "libraries": ["a.so", "b.so"], "python_modules": ["m1", "m2"]}
    assert plugin_list({}) == {"libraries": [], "python_modules": []}
    with pytest.raises(ValueError, match="'x::Unknown'"):
        plugin_list({"plugins": ["x::Unknown"]})


def test_precision_comes_from_the_dtypes():
    f16 = {"inputs": [{"name": "x", "dtype": "float16"}, {"name": "i", "dtype": "int64"}],
           "outputs": [{"name": "y", "dtype": "float16"}]}
    assert graph_precision(f16) == "float16"


def test_plan_of_an_ort_folder(tiny_engine):
    """No TRT-lowered graph yet: the ORT graphs' contract gives the profiles."""
    manifest = load_manifest(tiny_engine)
    plan = build_plan(manifest, max_batch=4, max_draft_tokens=3, max_len=64)
    assert [p.name for p in plan] == ["target"]
    p = plan[0]
    assert (p.onnx, p.engine, p.source_backend, p.precision) == (
        "target.onnx", "target.engine", "ort", "float32")
    prefill, decode = p.profiles
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert decode.shapes["input_ids"] == ((1, 1), (4, 4), (4, 4))
    assert prefill.shapes["input_ids"] == ((1, 1), (1, 64), (4, 64))
    c = manifest.config
    assert decode.shapes["past_key_values.0.key"] == tuple(
        (b, c.num_kv_heads, 64, c.head_dim) for b in (1, 4, 4))
    assert decode.shapes["total_sequence_length"] == ((), (), ())
    assert decode.values == {"total_sequence_length": (1, 64, 64)}
    with pytest.raises(ValueError, match="max_len=999"):
        build_plan(manifest, max_len=999)
    with pytest.raises(ValueError, match="graphs \\['nope'\\]"):
        build_plan(manifest, graphs=["nope"])


def test_plan_prefers_trt_graphs(tiny_engine):
    m = load_manifest(tiny_engine)
    data = json.loads(json.dumps(m.data))
    trt = dict(data["graphs"]["target"], backend="trt", files=["target_trt.onnx"],
               plugins={"python_modules": ["trt_spec.plugins.spec_verify"]})
    data["graphs"]["target_trt"] = trt
    plan = build_plan(Manifest(m.folder, data, m.config))
    assert [(p.name, p.source_backend) for p in plan] == [("target_trt", "trt")]
    assert plan[0].plugins["python_modules"] == ["trt_spec.plugins.spec_verify"]


def test_record_engines_updates_the_manifest(tiny_engine, tmp_path):
    folder = shutil.copytree(tiny_engine, tmp_path / "e")
    plan = build_plan(load_manifest(folder), max_batch=2, max_draft_tokens=2, max_len=32)
    (folder / "target.engine").write_bytes(b"not really an engine")
    info = record_engines(folder, "10.15.0", plan)
    m = load_manifest(folder)  # sha256 of every file, the engine included
    assert "target.engine" in m.data["files"] and "target.engine" in m.data["extra_files"]
    assert m.data["trt"]["version"] == "10.15.0" == info["version"]
    entry = m.data["trt"]["engines"]["target"]
    assert [p["name"] for p in entry["profiles"]] == ["prefill", "decode"]
    assert not list(folder.glob("*.partial"))


def test_build_without_tensorrt_fails_with_one_line(tiny_engine):
    result = CliRunner().invoke(main, ["build", str(tiny_engine)])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "TensorRT is not installed" in lines[0] and "pip install" in lines[0]


def test_build_dry_run_needs_no_tensorrt(tiny_engine):
    result = CliRunner().invoke(main, ["build", str(tiny_engine), "--dry-run", "--max-len", "32"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan[0]["profiles"][1]["shapes"]["input_ids"] == [[1, 1], [8, 5], [8, 5]]


# --- runtime/backends/trt.py: its pure parts ---------------------------------------------------

def profiles_for(max_len=64):
    plan = GraphPlan("t", "t.onnx", "t.engine", "ort", "float32", [
        Profile(n, {"input_ids": input_profile("input_ids", ["batch", "new_tokens"], r),
                    "logits_index": input_profile("logits_index", ["batch", "num_logits"], r)})
        for n, r in symbol_ranges(8, 4, max_len, max_len).items()], {})
    return json.loads(json.dumps([p.__dict__ for p in plan.profiles]))  # as the manifest has them


@pytest.mark.parametrize("batch,tokens,logits,want", [
    (1, 1, 1, "decode"), (8, 5, 5, "decode"), (1, 12, 1, "prefill"), (4, 32, 32, "prefill")])
def test_choose_profile(batch, tokens, logits, want):
    profiles = profiles_for()
    index = choose_profile(profiles, Bucket(0, batch, tokens, logits, False))
    assert profiles[index]["name"] == want


def test_choose_profile_refuses_what_no_profile_holds():
    with pytest.raises(ValueError, match="batch 16"):
        choose_profile(profiles_for(), Bucket(0, 16, 1, 1, False))


def test_buffer_shapes(tiny_engine):
    graph = load_manifest(tiny_engine).graph("target")
    shapes = buffer_shapes(graph["inputs"], graph["outputs"], Bucket(2, 4, 5, 5, False), 64)
    assert shapes["input_ids"] == (4, 5) and shapes["total_sequence_length"] == ()
    assert shapes["logits"] == (4, 5, 128)
    assert not any(n.startswith(("past_", "present")) for n in shapes)
    assert resolve_shape(["batch", 3], Bucket(0, 2, 1, 1, False), 8) == (2, 3)


def test_trt_modules_import_without_torch_or_tensorrt():
    from tests.no_torch import run_without_torch

    run_without_torch("""
        import trt_spec.export.trt_build, trt_spec.runtime.backends.trt
        import trt_spec.runtime.backends.buckets
    """)


def test_polygraphy_feeds_run_on_ort(tiny_engine):
    """The parity script's feeds are valid graph inputs: ORT runs them."""
    import importlib.util
    from pathlib import Path

    from trt_spec.runtime.backends.ort import make_session

    path = Path(__file__).resolve().parents[1] / "scripts" / "polygraphy_inputs.py"
    spec = importlib.util.spec_from_file_location("polygraphy_inputs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    graph = load_manifest(tiny_engine).graph("target")
    feeds = module.feeds(graph, max_len=32, batch=2, new_tokens=5, past=7)
    session = make_session(tiny_engine / "target.onnx")  # the process's shared ORT pool
    logits = session.run(["logits"], feeds)[0]
    assert logits.shape == (2, 5, 128)
