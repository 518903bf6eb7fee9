"""`trt-spec serve`'s options from the environment (TRT_SPEC_<OPTION>) and a TOML file
(--config), in the order flag > environment > file > default (trt_spec/cli/config.py): the
command is invoked in-process with the server replaced by a stub that keeps the ServeOptions
it was given, so no engine is loaded."""

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.cli.config import env_name, options, options_table
from trt_spec.serve import server

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


@pytest.fixture
def served(monkeypatch):
    """serve(*args, env=..., config=...) -> the ServeOptions the server would have run with,
    or the failed click Result."""
    got = []
    monkeypatch.setattr(server, "serve_engine", lambda options, say: got.append(options))
    for name in list(__import__("os").environ):
        if name.startswith("TRT_SPEC_"):  # the test's own environment plays no part
            monkeypatch.delenv(name)

    def serve(*args, env=None, config=None, tmp=None):
        if config is not None:
            path = tmp / "serve.toml"
            path.write_text(config)
            args = ("--config", str(path), *args)
        result = CliRunner().invoke(main, ["serve", *args], env=env or {})
        if result.exit_code != 0:
            return result
        return got.pop() if got else None

    return serve


def test_a_flag_beats_the_environment_which_beats_the_file(served, tmp_path):
    config = 'port = 7001\nmax-num-seqs = 3\nprefix_cache = false\nhost = "0.0.0.0"\n'
    options = served(config=config, tmp=tmp_path)
    assert (options.port, options.runtime.max_batch, options.runtime.prefix_cache,
            options.host) == (7001, 3, False, "0.0.0.0")
    env = {"TRT_SPEC_PORT": "7002", "TRT_SPEC_PREFIX_CACHE": "true"}
    options = served(env=env, config=config, tmp=tmp_path)
    assert (options.port, options.runtime.max_batch, options.runtime.prefix_cache) == \
        (7002, 3, True)
    options = served("--port", "7003", "--no-prefix-cache", env=env, config=config,
                     tmp=tmp_path)
    assert (options.port, options.runtime.prefix_cache) == (7003, False)
    options = served()  # none of them: the defaults
    assert (options.port, options.runtime.prefix_cache, options.log_format) == \
        (8000, True, "text")


def test_switches_lists_and_the_file_named_by_the_environment(served, tmp_path):
    path = tmp_path / "a.toml"
    path.write_text('allowed-origins = ["https://a.example", "https://b.example"]\n'
                    'docs = true\nlog-format = "json"\naccess_log = false\n'
                    'num-draft-tokens = "auto:4"\n')
    options = served(env={"TRT_SPEC_CONFIG": str(path)})
    assert options.allowed_origins == ("https://a.example", "https://b.example")
    assert (options.docs, options.log_format, options.access_log) == (True, "json", False)
    spec = options.runtime.speculation
    assert (spec.num_draft_tokens, spec.adaptive) == (4, True)
    env = {"TRT_SPEC_CONFIG": str(path), "TRT_SPEC_ALLOWED_ORIGINS": "https://c.example",
           "TRT_SPEC_DOCS": "0", "TRT_SPEC_ACCESS_LOG": "yes", "TRT_SPEC_NUM_DRAFT_TOKENS": "3"}
    options = served(env=env)
    assert options.allowed_origins == ("https://c.example",)
    assert (options.docs, options.access_log) == (False, True)
    spec = options.runtime.speculation
    assert (spec.num_draft_tokens, spec.adaptive) == (3, False)


@pytest.mark.parametrize("config, message", [
    ("prot = 80\n", "unknown key 'prot': the keys are the options' names, with dashes or "
                    "underscores: access-log, allowed-origins, api-key,"),
    ("port = 'abc'\n", "port = 'abc': expected an integer"),
    ("port = 70000\n", "port = 70000: 70000 is not in the range 0<=x<=65535"),
    ("port = 80.5\n", "port = 80.5: expected an integer"),
    ("prefix-cache = 'yes'\n", "prefix-cache = 'yes': expected true or false"),
    ("log_format = 'xml'\n", "log_format = 'xml': 'xml' is not one of 'text', 'json'"),
    ("allowed-origins = [1]\n", "allowed-origins = [1]: expected a list of strings or one "
                                "string"),
    ("max_num_seqs = 2\nmax-num-seqs = 3\n", "keys 'max_num_seqs' and 'max-num-seqs' name "
                                             "the same option; give one"),
    ("config = 'x.toml'\n", "unknown key 'config'"),
    ("port = \n", "is not TOML"),
    ("", "missing.toml: No such file or directory"),
])
def test_a_bad_file_names_the_key_the_value_and_what_is_allowed(served, tmp_path, config,
                                                                 message):
    result = served(config=config, tmp=tmp_path) if config else \
        served("--config", str(tmp_path / "missing.toml"))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--config" in text and message in text, text


def test_a_secret_is_never_quoted(served, tmp_path):
    result = served(config="api-key = 12345678\n", tmp=tmp_path)
    assert result.exit_code == 2 and "api-key = (hidden): expected a string" in result.output
    assert "12345678" not in result.output


@pytest.mark.parametrize("name, value, message", [
    ("TRT_SPEC_PREFIX_CACHE", "maybe", "'maybe' is not a valid boolean"),
    ("TRT_SPEC_PORT", "x", "'x' is not a valid integer"),
    ("TRT_SPEC_LOG_FORMAT", "xml", "'xml' is not one of 'text', 'json'"),
])
def test_a_bad_variable_names_itself(served, name, value, message):
    result = served(env={name: value})
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert f"(env var: '{name}')" in text and message in text, text


def test_help_shows_every_options_variable():
    command = main.commands["serve"]
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    names = [env_name(p) for p in options(command) if not p.hidden]
    assert len(names) > 40 and "TRT_SPEC_MAX_NUM_SEQS" in names
    missing = [n for n in names + ["TRT_SPEC_CONFIG"] if not re.search(
        rf"env var: {n}[;\]]", text)]
    assert not missing, missing


def test_ray_replicas_take_the_settings_from_the_environment_and_the_file(served, tmp_path,
                                                                           monkeypatch):
    """--ray hands the same ServeOptions to the replicas' config (ray_serve.replica_config):
    what the environment and the file set reaches every replica."""
    ray_serve = pytest.importorskip("trt_spec.serve.ray_serve",
                                    reason="needs the ray extra")
    got = []
    monkeypatch.setattr(ray_serve, "serve_on_ray",
                        lambda options, ray_options, checksum, say: got.append(
                            (options, ray_options)))
    env = {"TRT_SPEC_LOG_FORMAT": "json", "TRT_SPEC_API_KEY": "k-123",
           "TRT_SPEC_REPLICAS": "3"}
    result = served("--ray", env=env, config="access-log = false\nmax-body-bytes = 1000\n"
                                             "reasoning-in-content = true\n", tmp=tmp_path)
    assert result is None, result.output
    options, ray_options = got.pop()
    config = ray_serve.replica_config(options)
    assert (config.log_format, config.access_log, config.max_body_bytes,
            config.reasoning_in_content, config.access.api_key) == \
        ("json", False, 1000, True, "k-123")
    assert ray_options.replicas == 3
    assert "k-123" not in repr(config) + repr(options)


def test_the_docs_table_is_the_commands():
    """docs/serving.md holds the options table as options_table writes it (regenerate with
    `python scripts/docs_options.py`)."""
    table = options_table(main.commands["serve"])
    assert table in DOCS.read_text(), "docs/serving.md's options table is out of date: " \
                                      "run python scripts/docs_options.py"
