"""Portable engine folders: manifest.json records the source model, draft and heads relative
to the folder (names as they are), so a folder moved together with its checkpoints still
loads on the torch-cuda backend; older folders' absolute paths still read as they are."""

import json
import os
import shutil

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from trt_spec.cli import main  # noqa: E402
from trt_spec.runtime.generator import Generator  # noqa: E402
from trt_spec.runtime.manifest import (load_manifest, rebase_source,  # noqa: E402
                                       relative_source_path, source_path)
from trt_spec.runtime.settings import SpeculationConfig  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402
from trt_spec.runtime.scheduler import generate

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def source_values(source: dict) -> list:
    return [source["model"], source["draft_model"], *source["heads"].values()]


@pytest.fixture(scope="module")
def tree(tiny_hf_dir, tmp_path_factory):
    """root/{models/tiny, models/draft, heads/eagle3, engines/tiny}: the tiny target with a
    separate vanilla draft and a random Eagle3 head, exported from relative paths."""
    from tests.random_drafters import eagle3_tensors, write_checkpoint
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(tiny_hf_dir, root / "models" / "tiny")
    shutil.copytree(tiny_hf_dir, root / "models" / "draft")
    _, config = load_target(tiny_hf_dir)
    tensors, hf = eagle3_tensors(config, seed=3)
    hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    write_checkpoint(root / "heads" / "eagle3", tensors, hf)
    cwd = os.getcwd()
    os.chdir(root)  # paths as a user types them, relative to the working directory
    try:
        export_model(ExportConfig("models/tiny", root / "engines" / "tiny", "fp32",
                                  drafters={"vanilla": str(root / "models" / "draft"),  # absolute
                                            "eagle3": "heads/eagle3"}))
    finally:
        os.chdir(cwd)
    return root


def outputs(folder, **kw) -> dict:
    """Greedy token ids of plain decoding, the vanilla draft and the Eagle3 head."""
    out = {}
    for method in ("none", "vanilla", "eagle3"):
        spec = None if method == "none" else SpeculationConfig(num_draft_tokens=3,
                                                               min_acceptance=0)
        gen = Generator(folder, method=method, max_batch=1, max_len=64, speculation=spec, **kw)
        out[method] = generate(gen, ["a b c"], GREEDY, chat=False)[0].token_ids
    return out


def test_source_records_no_absolute_path(tree):
    source = load_manifest(tree / "engines" / "tiny").data["source"]
    assert source["model"] == "../../models/tiny"
    assert source["draft_model"] == "../../models/draft"
    assert source["heads"] == {"eagle3": "../../heads/eagle3"}
    drafter = load_manifest(tree / "engines" / "tiny").data["drafters"]["eagle3"]
    assert drafter["source"] == "../../heads/eagle3"
    assert not any(os.path.isabs(v) for v in source_values(source))


def test_a_copied_tree_loads_on_torch_cuda(tree, tmp_path):
    """The folder and its checkpoints copied elsewhere (the original gone): the torch-cuda
    backend finds the weights beside it and answers as the ORT graphs do."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(tree, copy)
    moved = tmp_path / "moved-away"
    shutil.move(str(tree), moved)  # the exporting machine's paths no longer exist
    try:
        folder = copy / "engines" / "tiny"
        ort = outputs(folder)
        torch_cuda = outputs(folder, backend="torch-cuda", device="cpu", cuda_graphs=False)
        assert torch_cuda == ort
    finally:
        shutil.move(str(moved), tree)


def test_export_again_skips_an_up_to_date_folder(tree, capfd):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    folder = tree / "engines" / "tiny"
    before = (folder / "manifest.json").stat().st_mtime_ns
    export_model(ExportConfig(str(tree / "models" / "tiny"), folder, "fp32",
                              drafters={"vanilla": str(tree / "models" / "draft"),
                                        "eagle3": str(tree / "heads" / "eagle3")}))
    assert "is up to date" in capfd.readouterr().err
    assert (folder / "manifest.json").stat().st_mtime_ns == before


def test_source_path_names_and_old_absolute_paths(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "model").mkdir()
    engine = tmp_path / "engine"
    assert source_path(engine, "smollm2-135m") == "smollm2-135m"  # a model name
    assert source_path(engine, str(tmp_path / "model")) == str(tmp_path / "model")  # old
    assert source_path(engine, "../model") == str(tmp_path / "model")
    assert source_path(engine, "../gone/x.gguf") == str(tmp_path / "gone" / "x.gguf")
    assert source_path(engine, None) is None
    assert relative_source_path(tmp_path / "engine" / "hf", engine) == "./hf"
    assert source_path(engine, "./hf") == str(engine / "hf")


def test_a_bundle_rebases_the_source_paths(tree, tmp_path):
    folder = tree / "engines" / "tiny"
    source = load_manifest(folder).data["source"]
    rebased = rebase_source(source, folder, tmp_path / "b")
    for key in ("model", "draft_model"):
        assert (os.path.normpath(os.path.join(tmp_path / "b", rebased[key]))
                == source_path(folder, source[key]))
    assert rebased["precision"] == source["precision"]
    result = CliRunner().invoke(main, ["bundle", str(folder), str(tmp_path / "bundle"),
                                       "--methods", "eagle3"])
    assert result.exit_code == 0, result.output
    bundled = json.loads((tmp_path / "bundle" / "manifest.json").read_text())["source"]
    assert (source_path(tmp_path / "bundle", bundled["model"])
            == source_path(folder, source["model"]))
