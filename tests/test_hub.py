"""Models by name (export/hub.py): `trt-spec export --model org/name[@revision]` against a
Hugging Face cache the tests build, offline (HF_HUB_OFFLINE=1: no test reaches the network).

The cache is laid out as huggingface_hub writes it (`put_in_cache`): models--org--name/ with
blobs/<sha256>, snapshots/<commit>/<file> linking to them and refs/<revision> naming a commit.
The hub's own answers (gated, missing) come from snapshot_download made to raise them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
huggingface_hub = pytest.importorskip("huggingface_hub")

from click.testing import CliRunner  # noqa: E402
from huggingface_hub import constants, errors  # noqa: E402

from tests.conftest import make_tiny_hf  # noqa: E402
from trt_spec.cli import main  # noqa: E402
from trt_spec.export.checkpoint import resolve_model  # noqa: E402
from trt_spec.export.config import ExportConfig  # noqa: E402
from trt_spec.export.hub import FILES, HubError, hub_name  # noqa: E402
from trt_spec.export.pipeline import export_model  # noqa: E402
from trt_spec.runtime.manifest import load_manifest, rebase_source, source_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMIT_A, COMMIT_B, COMMIT_C = "a" * 40, "b" * 40, "c" * 40


def put_in_cache(cache: Path, repo_id: str, folder: Path, commit: str,
                 refs: tuple[str, ...] = ("main",), listed: bool = False) -> Path:
    """`folder`'s files as revision(s) `refs` at `commit` of `repo_id` in the hub cache
    `cache` -> the snapshot folder. listed: also the tree listing snapshot_download caches
    after asking the hub (what it knows of the repository's files offline)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    entries = {}
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
        entries[path.name] = (len(data), blob.name)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    if listed:
        from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

        write_tree_cache(str(repo), commit, {name: TreeCacheEntry(size, sha[:40])
                                             for name, (size, sha) in entries.items()})
    return snapshot


@pytest.fixture(autouse=True)
def never_online(monkeypatch):
    """Whatever a test forgets, huggingface_hub makes no request (OfflineModeIsEnabled)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory):
    """A second tiny Llama (other weights): revision v2 of the repository."""
    return make_tiny_hf(tmp_path_factory.mktemp("tiny-b"), seed=5)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline: the environment for subprocesses, huggingface_hub's
    constants (read at its import) for this one."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def greedy(engine: Path, method: str = "none") -> list[list[int]]:
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.scheduler import generate_ids

    gen = Generator(engine, method=method, max_batch=2)
    prompts = [[5, 17, 33, 9, 60], [3, 3, 80, 41, 12, 7, 99]]
    return [s.output_ids for s in generate_ids(gen, prompts, SamplingParams(max_tokens=16,
                                                                            ignore_eos=True))]


def test_export_by_name_offline_equals_the_local_folder(tiny_hf_dir, hub_cache, tmp_path):
    """`trt-spec export --model org/tiny --eagle3 org/tiny-eagle3` in a process whose only
    hub settings are HF_HOME and HF_HUB_OFFLINE=1: the engine is the local folder's (same
    greedy output), its Eagle3 head drafts it exactly, and the manifest names the commits."""
    from tests.random_drafters import eagle3_tensors, write_checkpoint
    from trt_spec.export.checkpoint import config_from_hf

    config = config_from_hf(json.loads((tiny_hf_dir / "config.json").read_text()))
    head = write_checkpoint(tmp_path / "e3", *eagle3_tensors(config, seed=1, layout="model"))
    put_in_cache(hub_cache, "org/tiny", tiny_hf_dir, COMMIT_A)
    put_in_cache(hub_cache, "org/tiny-eagle3", head, COMMIT_C)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}  # HF_HOME alone
    by_name = tmp_path / "by-name"
    run = subprocess.run([sys.executable, "-m", "trt_spec.cli", "export", "--model", "org/tiny",
                          "--eagle3", "org/tiny-eagle3", "--precision", "fp32", "--out",
                          str(by_name)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    local = export_model(ExportConfig(str(tiny_hf_dir), tmp_path / "local", "fp32"))
    assert greedy(by_name) == greedy(local)
    assert greedy(by_name, "eagle3") == greedy(local)
    source = load_manifest(by_name).data["source"]
    assert source["model"] == f"hf://org/tiny@{COMMIT_A}"
    assert source["heads"] == {"eagle3": f"hf://org/tiny-eagle3@{COMMIT_C}"}
    # the manifest's hub names are read as names, never as paths beside the folder, and the
    # torch backend reloads those commits from the cache
    assert source_path(by_name, source["model"]) == source["model"]
    assert rebase_source(source, by_name, tmp_path / "elsewhere")["model"] == source["model"]
    from trt_spec.export.torch_backend import TorchGraphs

    manifest = load_manifest(by_name)
    graphs = TorchGraphs.from_manifest(manifest, device="cpu", cuda_graphs=False)
    assert set(graphs.modules) == set(manifest.data["graphs"])


def test_a_revision_picks_its_snapshot(tiny_hf_dir, tiny_b, hub_cache, tmp_path):
    """@v2 (a tag), @<commit> and the default branch each read their own snapshot; an
    export is up to date until the branch it named moves to another commit."""
    a = put_in_cache(hub_cache, "org/tiny", tiny_hf_dir, COMMIT_A)
    b = put_in_cache(hub_cache, "org/tiny", tiny_b, COMMIT_B, refs=("v2",))
    assert resolve_model("org/tiny") == a
    assert resolve_model("org/tiny@v2") == resolve_model(f"org/tiny@{COMMIT_B}") == b
    assert resolve_model(f"hf://org/tiny@{COMMIT_B}") == b

    v2 = export_model(ExportConfig("org/tiny@v2", tmp_path / "v2", "fp32"))
    assert load_manifest(v2).data["source"]["model"] == f"hf://org/tiny@{COMMIT_B}"
    main = export_model(ExportConfig("org/tiny", tmp_path / "main", "fp32"))
    assert greedy(v2) != greedy(main)  # other weights
    stamp = (main / "manifest.json").stat().st_mtime_ns
    export_model(ExportConfig("org/tiny", main, "fp32"))  # same commit: up to date
    assert (main / "manifest.json").stat().st_mtime_ns == stamp
    (hub_cache / "models--org--tiny" / "refs" / "main").write_text(COMMIT_B)
    export_model(ExportConfig("org/tiny", main, "fp32"))  # main moved: exported again
    assert load_manifest(main).data["source"]["model"] == f"hf://org/tiny@{COMMIT_B}"
    assert greedy(main) == greedy(v2)


def test_only_the_index_shards_and_the_config_files_are_asked_for(tiny_hf_dir, hub_cache,
                                                                    tmp_path, monkeypatch):
    """A sharded checkpoint: snapshot_download is asked for the config and tokenizer files,
    then for exactly the shards the index lists; never for a pickle."""
    import torch
    import transformers

    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_hf_dir / name).read_bytes())
    shards = sorted(json.loads((sharded / "model.safetensors.index.json").read_text())
                    ["weight_map"].values())
    assert len(set(shards)) > 1
    torch.save({}, sharded / "pytorch_model.bin")  # beside them in the repository
    put_in_cache(hub_cache, "org/sharded", sharded, COMMIT_A)

    asked = []
    real = huggingface_hub.snapshot_download

    def spy(repo_id, **kwargs):
        asked.append((kwargs["revision"], kwargs["allow_patterns"]))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    folder = resolve_model("org/sharded")
    assert asked == [(None, list(FILES)), (COMMIT_A, sorted(set(shards)))]
    assert not any(p.endswith((".bin", ".pth", ".pt")) for _, patterns in asked
                   for p in patterns)
    from trt_spec.export.checkpoint import load_target

    got, want = load_target(folder)[0].state_dict(), load_target(tiny_hf_dir)[0].state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_missing_repository_or_revision_offline_says_what_the_cache_holds(tiny_hf_dir,
                                                                          hub_cache, tmp_path):
    put_in_cache(hub_cache, "org/tiny", tiny_hf_dir, COMMIT_A, refs=("main", "v1"))
    for model, words in [
            ("org/nothing", ["'org/nothing'", "is not in the Hugging Face cache at "
                             f"{hub_cache}", "HF_HUB_OFFLINE is set", "unset it"]),
            ("org/tiny@v9", ["'org/tiny@v9'", "revision 'v9' of 'org/tiny' is not in",
                             "(it holds main, v1)", "HF_HUB_OFFLINE"])]:
        out = tmp_path / "engine"
        result = CliRunner().invoke(main, ["export", "--model", model, "--out", str(out)])
        assert result.exit_code != 0
        for w in words:
            assert w in result.output, (w, result.output)
        assert not out.exists()


def test_pickled_weights_are_refused(hub_cache, tmp_path):
    """A repository with only pytorch_model.bin: refused, saying why (the tree listing
    names the pickle); with no listing cached, the safetensors file is named as missing."""
    import torch

    folder = tmp_path / "pickles"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    put_in_cache(hub_cache, "org/pickles", folder, COMMIT_A, listed=True)
    with pytest.raises(HubError, match=r"'org/pickles' \(commit a{40}\) publishes its weights "
                       r"only as pickles \(pytorch_model.bin\): trt-spec never loads pickled"):
        resolve_model("org/pickles")
    put_in_cache(hub_cache, "org/unlisted", folder, COMMIT_A)
    with pytest.raises(HubError, match="'org/unlisted' .*: model.safetensors not in the Hugging "
                       "Face cache at .* and HF_HUB_OFFLINE is set"):
        resolve_model("org/unlisted")


def http_error(cls, status: int, repo_id: str):
    """The hub's exception as huggingface_hub raises it: a message and the HTTP response."""
    import httpx2

    url = f"https://huggingface.co/api/models/{repo_id}/revision/main"
    response = httpx2.Response(status, request=httpx2.Request("GET", url))
    return cls(f"{status} Client Error. for url: {url}", response=response)


@pytest.mark.parametrize("cls, status, words", [
    (errors.GatedRepoError, 403, ["'meta-llama/Llama-3.2-1B@main' is a gated repository",
                                  "accept its licence", "HF_TOKEN", "hf auth login"]),
    (errors.RepositoryNotFoundError, 401, ["'meta-llama/Llama-3.2-1B@main': no such repository",
                                           "nor a local file or folder", "HF_TOKEN"]),
    (errors.RevisionNotFoundError, 404, ["repository 'meta-llama/Llama-3.2-1B' has no revision "
                                         "'main'"]),
    (errors.HfHubHTTPError, 500, ["the hub", "answered: 500 Client Error."]),
])
def test_the_hubs_refusals_say_what_to_do(cls, status, words, monkeypatch, tmp_path):
    def refuse(repo_id, **kwargs):
        raise http_error(cls, status, repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    result = CliRunner().invoke(main, ["export", "--model", "meta-llama/Llama-3.2-1B@main",
                                       "--out", str(tmp_path / "x")])
    assert result.exit_code != 0
    for w in words:
        assert w in result.output, (w, result.output)


def test_no_network_says_where_the_cache_is(monkeypatch, hub_cache):
    """The hub out of reach (snapshot_download's LocalEntryNotFoundError, online)."""
    def unreachable(repo_id, **kwargs):
        raise errors.LocalEntryNotFoundError("Connection error, and we cannot find the files")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(HubError, match=f"'org/x' is not in the Hugging Face cache at "
                       f"{hub_cache}, and the hub .* could not be reached: check the network "
                       ".*HF_HUB_OFFLINE=1"):
        resolve_model("org/x")


@pytest.mark.parametrize("spec, name", [
    ("meta-llama/Llama-3.2-1B-Instruct", ("meta-llama/Llama-3.2-1B-Instruct", None)),
    ("Qwen/Qwen2.5-0.5B@v1.0", ("Qwen/Qwen2.5-0.5B", "v1.0")),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ("hf://org/name", ("org/name", None)),
    ("smollm2-135m", None), ("gpt-17", None), ("a/b/c", None), ("./x", None),
    ("models/q.gguf", None), ("org/na--me", None),
])
def test_what_a_string_is(spec, name):
    got = hub_name(spec)
    assert (got and (got.repo_id, got.revision)) == name


def test_malformed_names_are_refused_quoting_them(tmp_path):
    for spec in ("name@v1", "org/-x@main", "hf://a/b/c", "org/name@"):
        with pytest.raises(ValueError, match=f"{spec!r} is not a Hugging Face repository id "
                           r"\(org/name or org/name@revision"):
            hub_name(spec)
    with pytest.raises(ValueError, match="'org/na--me' is not a known name .* or a hub name "
                       r"\(org/name or org/name@revision\)"):
        resolve_model("org/na--me")
    result = CliRunner().invoke(main, ["export", "--model", str(tmp_path), "--eagle3",
                                       "not/a/folder"])
    assert result.exit_code != 0
    assert "'not/a/folder' is not a folder, nor a hub name" in result.output


def test_local_paths_win_and_engines_are_named_after_the_repository(tiny_hf_dir, tmp_path,
                                                                     monkeypatch):
    """A folder that exists is read as it is, even where its path reads as org/name."""
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny").symlink_to(tiny_hf_dir)
    monkeypatch.chdir(tmp_path)
    assert hub_name("org/tiny") is None and resolve_model("org/tiny") == Path("org/tiny")
    assert ExportConfig("meta-llama/Llama-3.2-1B-Instruct@main").out == \
        Path("engines/Llama-3.2-1B-Instruct")
    assert ExportConfig(f"hf://org/x@{COMMIT_A}").out == Path("engines/x")
    assert ExportConfig("org/tiny").out == Path("engines/tiny")
