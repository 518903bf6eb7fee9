"""An engine folder reads only its own files, and a malformed manifest gets one line naming
the file and the field: at load, at `trt-spec verify` and at `trt-spec bundle`."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.tools.bundle import bundle, verify
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.manifest import EngineFolderError, file_entries, load_manifest


@pytest.fixture
def folder(tiny_engine, tmp_path):
    """A private copy of the tiny engine folder, and a directory beside it (outside)."""
    shutil.copytree(tiny_engine, tmp_path / "engine")
    (tmp_path / "outside").mkdir()
    return tmp_path / "engine"


def manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def write(folder, data):
    (folder / "manifest.json").write_text(json.dumps(data))


def plant(folder, name, source):
    """An outside copy of `source` named `name` in the manifest, its size and sha256 right."""
    data = manifest(folder)
    data["files"][name] = file_entries(folder, [source])[source]
    return data


def test_absolute_and_dotdot_entries_are_refused_even_with_right_checksums(folder):
    outside = folder.parent / "outside" / "target.onnx"
    shutil.copy(folder / "target.onnx", outside)
    for name in (str(outside), "../outside/target.onnx", "sub/../../outside/target.onnx"):
        data = plant(folder, "target.onnx", "target.onnx")
        data["files"][name] = data["files"].pop("target.onnx")
        data["graphs"]["target"]["files"][0] = name
        write(folder, data)
        for check in (load_manifest, lambda f: load_manifest(f, verify="none"), verify,
                      lambda f: bundle(f, folder.parent / "b")):
            with pytest.raises(EngineFolderError, match="absolute path|leads out") as e:
                check(folder)
            assert "manifest.json" in str(e.value) and "\n" not in str(e.value)
        assert not (folder.parent / "b").exists()


def test_a_symlink_leading_out_is_refused(folder):
    outside = folder.parent / "outside" / "tokenizer.json"
    shutil.copy(folder / "tokenizer.json", outside)
    (folder / "tokenizer.json").unlink()
    os.symlink(outside, folder / "tokenizer.json")  # same bytes: checksum and size still match
    with pytest.raises(EngineFolderError, match="tokenizer.json.*outside the folder"):
        load_manifest(folder)
    with pytest.raises(EngineFolderError, match="outside the folder"):
        Generator(folder, verify="none")
    # a symlinked folder itself is fine, and so is a link that stays inside
    os.symlink(folder, folder.parent / "alias")
    (folder / "tokenizer.json").unlink()
    shutil.copy(outside, folder / "tok-real.json")
    os.symlink("tok-real.json", folder / "tokenizer.json")
    data = plant(folder, "tok-real.json", "tok-real.json")
    write(folder, data)
    assert load_manifest(folder.parent / "alias").path("tokenizer.json").is_file()


def test_a_tokenizer_not_in_the_manifest_cannot_link_out(folder):
    data = manifest(folder)
    data["tokenizer"]["files"] = [f for f in data["tokenizer"]["files"]
                                  if f != "tokenizer_config.json"]
    data["files"].pop("tokenizer_config.json")
    write(folder, data)
    shutil.copy(folder / "tokenizer_config.json", folder.parent / "outside" / "t.json")
    (folder / "tokenizer_config.json").unlink()
    os.symlink(folder.parent / "outside" / "t.json", folder / "tokenizer_config.json")
    with pytest.raises(EngineFolderError, match="tokenizer_config.json.*outside the folder"):
        Generator(folder)


def malformed(data: dict) -> dict:
    """Each: a manifest -> (bytes written, the field the message must name)."""
    graphs_no_backend = json.loads(json.dumps(data))
    del graphs_no_backend["graphs"]["target"]["backend"]
    no_bytes = json.loads(json.dumps(data))
    del no_bytes["files"]["target.onnx"]["bytes"]
    unlisted = json.loads(json.dumps(data))
    unlisted["graphs"]["target"]["files"].append("x.onnx")
    return {
        "json list": (b"[1, 2]", "top level"),
        "files as a list": (json.dumps({**data, "files": list(data["files"])}).encode(),
                            "files"),
        "entry without bytes": (json.dumps(no_bytes).encode(), "files['target.onnx']"),
        "bytes as text": (json.dumps({**data, "files": {**data["files"], "target.onnx": {
            **data["files"]["target.onnx"], "bytes": "12"}}}).encode(), ".bytes"),
        "graph without backend": (json.dumps(graphs_no_backend).encode(), "graphs.target"),
        "graph files unlisted": (json.dumps(unlisted).encode(), "graphs.target.files"),
        "tokenizer as a string": (json.dumps({**data, "tokenizer": "x"}).encode(),
                                  "tokenizer"),
        "drafters as a list": (json.dumps({**data, "drafters": []}).encode(), "drafters"),
        "model_config as a list": (json.dumps({**data, "model_config": []}).encode(),
                                   "model_config"),
        "random bytes": (bytes(range(256)) * 4, "not UTF-8"),
        "deep nesting": (b"[" * 100000, "not valid JSON"),
    }


@pytest.mark.parametrize("case", ["json list", "files as a list", "entry without bytes",
                                  "bytes as text", "graph without backend",
                                  "graph files unlisted", "tokenizer as a string",
                                  "drafters as a list", "model_config as a list",
                                  "random bytes", "deep nesting"])
def test_malformed_manifest_is_one_line_naming_the_file_and_field(folder, case):
    raw, field = malformed(manifest(folder))[case]
    (folder / "manifest.json").write_bytes(raw)
    with pytest.raises(EngineFolderError) as e:
        load_manifest(folder)
    message = str(e.value)
    assert str(folder / "manifest.json") in message and field in message, message
    assert "\n" not in message
    result = CliRunner().invoke(main, ["verify", str(folder)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: ") and field in result.output
    assert result.output.count("\n") == 1
