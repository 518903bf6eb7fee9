"""Models by name on the Hugging Face hub: `org/name[@revision]` -> a folder in the hub's cache.

    hub_name("meta-llama/Llama-3.2-1B-Instruct@main")  # HubName(repo_id, revision)
    download(name)        # Snapshot(folder, repo_id, commit): config, tokenizer, safetensors
    pin("org/name")       # "hf://org/name@<commit>": what the manifest records

What a string given as a model or a drafter is, in this order (export/checkpoint.py
resolve_model, `local_folder`):

    a known model name (smollm2-135m)        the GGUF route (export/checkpoint.py)
    an existing local path (file or folder)  itself, as before
    org/name, org/name@revision              a repository on the hub, fetched here
    hf://org/name[@revision]                 the same, never a local path (the manifest's form,
                                             its revision the commit exported)

Downloads go through huggingface_hub's snapshot_download, so its cache and its environment
apply: HF_HOME / HF_HUB_CACHE (where), HF_TOKEN or `hf auth login` (gated and private
repositories), HF_HUB_OFFLINE=1 (the cache only), HF_ENDPOINT (a mirror); it shows progress
bars and resumes an interrupted file. Only what export reads is fetched: the config files, the
tokenizer's and the safetensors weights (the shards the index lists, so that a repository that
also publishes another copy of its weights is not fetched twice). Pickled weights (.bin, .pth,
.pt) are never fetched: loading one can run code.

Torch-free, and huggingface_hub is imported on first download: export/config.py names engine
folders with `hub_name`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from trt_spec.runtime.manifest import HUB_PREFIX as PREFIX  # hf://: never a local path

FORMS = "org/name or org/name@revision"
# huggingface_hub's rules (utils/_validators.py validate_repo_id), with the namespace required:
# letters, digits, '-', '_', '.'; no '--' or '..'; not starting or ending with '-' or '.'
_PART = r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[\w.\-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"(?a:{_PART}/{_PART})")
REVISION = re.compile(r"(?a:(?!.*\.\.)[\w][\w.\-/]*)")  # a branch, tag or commit (refs/pr/1)
COMMIT = re.compile(r"[0-9a-f]{40}")

# What export reads besides the weights (top level only: a pattern without '/' matches only
# there). The tokenizer's files, the generation config, the drafters' own configs
# (trt-spec's drafter.json; EAGLE3 / MTP heads carry a config.json).
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
         "tokenizer.model", "drafter.json", "model.safetensors.index.json")
WEIGHTS = "model.safetensors"  # the weights of a repository without an index
PICKLES = (".bin", ".pth", ".pt", ".pkl", ".ckpt")


class HubError(ValueError):
    """A model named on the hub cannot be had: the message quotes it and says what to do."""


@dataclass(frozen=True)
class HubName:
    """A repository on the hub, at a revision."""

    repo_id: str  # org/name
    revision: str | None = None  # a branch, tag or commit hash; None: the default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        """The repository's name (the engine folder's default name)."""
        return self.repo_id.split("/")[1]


@dataclass(frozen=True)
class Snapshot:
    """A repository's files at one commit, in the hub's cache."""

    folder: Path  # <cache>/models--org--name/snapshots/<commit>
    repo_id: str
    commit: str  # 40 hex digits

    @property
    def pinned(self) -> str:
        """hf://org/name@<commit>: this very snapshot, by name."""
        return f"{PREFIX}{self.repo_id}@{self.commit}"


def hub_name(spec) -> HubName | None:
    """`spec` as a hub name, or None when it is not one: an existing local path, a .gguf
    file's, or a string without the org/name form (a known model's name, a typo'd path).
    ValueError for an hf:// name or an org/name@revision whose id or revision is malformed."""
    text = str(spec)
    explicit = text.startswith(PREFIX)
    if explicit:
        text = text[len(PREFIX):]
    elif Path(text).exists() or text.endswith(".gguf") \
            or (text.count("/") != 1 and "@" not in text):  # a path, a .gguf file, a name
        return None
    repo_id, at, revision = text.partition("@")
    if REPO_ID.fullmatch(repo_id) and (not at or REVISION.fullmatch(revision)) \
            and not repo_id.endswith(".git"):
        return HubName(repo_id, revision or None)
    if explicit or at:
        raise ValueError(f"{spec!r} is not a Hugging Face repository id ({FORMS}: letters, "
                         "digits, '-', '_' and '.', no '--' or '..')")
    return None


def download(name: HubName) -> Snapshot:
    """The repository's config, tokenizer and safetensors files at `name.revision`, from the
    hub's cache or downloaded into it -> the snapshot. HubError when the repository, its
    revision or its weights cannot be had (gated, missing, offline, pickles only)."""
    folder = _snapshot(name, name.revision, list(FILES))  # resolves the revision too
    commit = folder.name
    assert COMMIT.fullmatch(commit), folder
    weights = weight_files(folder)
    _snapshot(name, commit, weights)  # pinned to the same commit
    missing = [w for w in weights if not (folder / w).is_file()]
    if missing:
        raise HubError(missing_weights(name, commit, missing))
    if not (folder / "config.json").is_file() and not (folder / "drafter.json").is_file():
        raise HubError(f"{str(name)!r} (commit {commit}) has no config.json: not a "
                       "transformers checkpoint, nor a trt-spec drafter")
    return Snapshot(folder, name.repo_id, commit)


def pin(spec: str) -> str:
    """A model or drafter as export records it: a hub name -> hf://org/name@<commit>
    (downloaded, or found in the cache); anything else (a known name, a local path) as it is."""
    name = hub_name(spec)
    return spec if name is None else download(name).pinned


def local(spec: str) -> str:
    """A hub name -> its snapshot's folder (downloaded, or found in the cache); anything
    else as it is."""
    name = hub_name(spec)
    return spec if name is None else str(download(name).folder)


def local_folder(spec: str, what: str) -> Path:
    """A drafter's checkpoint, given as a folder or a hub name -> the folder."""
    path = Path(local(spec))
    if path.is_dir():
        return path
    raise ValueError(f"{what} checkpoint {spec!r} is not a folder, nor a Hugging Face "
                     f"repository id ({FORMS})")


def weight_files(folder: Path) -> list[str]:
    """The safetensors files a snapshot's weights are in: the shards its index lists, else
    model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return [WEIGHTS]
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    bad = [f for f in files if not f.endswith(".safetensors") or "/" in f or f.startswith(".")]
    if bad:
        raise HubError(f"{index}: its weight_map names {bad[:4]}; expected .safetensors files "
                       "beside it")
    return files


# --- the hub's answers, as errors that say what to do ---------------------------------------

def _snapshot(name: HubName, revision: str | None, patterns: list[str]) -> Path:
    """snapshot_download, its errors turned into HubError naming `name` and the fix."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        return Path(huggingface_hub.snapshot_download(name.repo_id, revision=revision,
                                                      allow_patterns=patterns))
    except errors.GatedRepoError as e:  # before RepositoryNotFoundError, its base class
        raise HubError(
            f"{str(name)!r} is a gated repository: accept its licence on the hub "
            f"({endpoint()}/{name.repo_id}) with your account, then set HF_TOKEN to a token of "
            "that account or run `hf auth login`") from e
    except errors.RepositoryNotFoundError as e:
        raise HubError(
            f"{str(name)!r}: no such repository on the hub ({endpoint()}), nor a local file or "
            f"folder of that name. Check the spelling ({FORMS}); a private repository needs "
            "HF_TOKEN (or `hf auth login`)") from e
    except errors.RevisionNotFoundError as e:
        raise HubError(f"{str(name)!r}: repository {name.repo_id!r} has no revision "
                       f"{revision!r} (a branch, tag or commit hash)") from e
    except errors.LocalEntryNotFoundError as e:  # offline, or the hub out of reach
        raise HubError(not_cached(name, revision)) from e
    except errors.HfHubHTTPError as e:
        raise HubError(f"{str(name)!r}: the hub ({endpoint()}) answered: "
                       f"{str(e).splitlines()[0]}") from e


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_revisions(repo_id: str) -> list[str]:
    """The branches and tags the cache holds a commit for (refs/), for the message."""
    refs = cache_root() / ("models--" + repo_id.replace("/", "--")) / "refs"
    return sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) \
        if refs.is_dir() else []


def not_cached(name: HubName, revision: str | None) -> str:
    """Why a name was not found offline: what the cache holds, and what to do."""
    where = f"the Hugging Face cache at {cache_root()}"
    held = cached_revisions(name.repo_id)
    if held:
        found = (f"revision {revision or 'main'!r} of {name.repo_id!r} is not in {where} "
                 f"(it holds {', '.join(held)})")
    else:
        found = f"{name.repo_id!r} is not in {where}"
    reach = ("HF_HUB_OFFLINE is set, so the hub was not asked: unset it to download, or set "
             "HF_HOME to the cache that holds it" if offline() else
             f"and the hub ({endpoint()}) could not be reached: check the network (HF_ENDPOINT "
             "names a mirror), or set HF_HOME to a cache that holds it and HF_HUB_OFFLINE=1")
    return f"{str(name)!r}: {found}, {reach}"


def missing_weights(name: HubName, commit: str, missing: list[str]) -> str:
    """Why a snapshot has no weights: the repository publishes only pickles, none at all, or
    (offline) the cache lacks them."""
    files = repo_files(name.repo_id, commit)
    if files is None:  # no listing: the cache is all we know
        return (f"{str(name)!r} (commit {commit}): {', '.join(missing)} not in the Hugging "
                f"Face cache at {cache_root()}"
                + (" and HF_HUB_OFFLINE is set: unset it to download" if offline() else ""))
    pickles = [f for f in files if f.endswith(PICKLES)]
    if pickles:
        return (f"{str(name)!r} (commit {commit}) publishes its weights only as pickles "
                f"({', '.join(pickles[:3])}): trt-spec never loads pickled weights, since "
                "loading one can run code. Use a repository with safetensors weights, or "
                "convert them yourself where you trust the file")
    return (f"{str(name)!r} (commit {commit}) has no {', '.join(missing)}: export reads "
            "safetensors weights (model.safetensors, or the shards model.safetensors.index.json "
            "lists)")


def repo_files(repo_id: str, commit: str) -> list[str] | None:
    """The repository's files at `commit` as the hub listed them to snapshot_download (its
    cached tree listing: no network), or None where none is cached."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit)]
    except CachedRepoTreeNotFoundError:
        return None

