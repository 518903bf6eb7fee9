"""Where a command's options come from besides its command line (`trt-spec serve`'s): an
environment variable each, and a TOML file. The first that gives a value wins:

    --flag VALUE  >  TRT_SPEC_<OPTION>  >  --config FILE (key <option>)  >  the default

    TRT_SPEC_<OPTION>   the option's long name, upper case, dashes to underscores
                        (--max-num-seqs: TRT_SPEC_MAX_NUM_SEQS); a switch takes
                        1/0, true/false, yes/no, on/off; a repeatable option takes its
                        values separated by spaces. `--help` shows each name.
    --config FILE       TOML, one key per option: its long name, with dashes or underscores
                        (max-num-seqs = 4, prefix_cache = false, allowed-origins = ["*"]);
                        TRT_SPEC_CONFIG names the file too

click orders the sources itself (an option's `envvar`, then the context's `default_map`, which
the file fills). Here the names are set and the file is read and checked once, before any
option is: a key that names no option, or a value of the wrong kind (a switch takes a TOML
boolean, a repeatable option a list or a string, a number a number), is refused with the
file, the key, the value and what is allowed. A secret's value (the API key) is never quoted.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import click

PREFIX = "TRT_SPEC_"
SECRETS = frozenset({"api_key"})  # a value never quoted in an error


def long_name(param: click.Option) -> str:
    """The option's long name without its dashes (--ray -> ray, --prefix-cache -> prefix-cache)."""
    return next(o for o in param.opts if o.startswith("--"))[2:]


def env_name(param: click.Option) -> str:
    return PREFIX + long_name(param).upper().replace("-", "_")


def options(command: click.Command) -> list[click.Option]:
    """The command's options that a variable or the file may set (not --help, --config)."""
    return [p for p in command.params if isinstance(p, click.Option) and p.expose_value
            and any(o.startswith("--") for o in p.opts)]


def configurable(command: click.Command) -> click.Command:
    """`command` with an environment variable on every option (shown in --help) and
    --config FILE. Returns the command."""
    for param in options(command):
        param.envvar = env_name(param)
        param.show_envvar = True
    command.params.insert(0, click.Option(
        ["--config"], type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
        callback=read_config, envvar=PREFIX + "CONFIG", show_envvar=True,
        help="A TOML file of option values, one key per option (its long name: "
             "max-num-seqs = 4); an option's flag or environment variable overrides it."))
    return command


def read_config(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """--config's callback: the file's values become the command's defaults (default_map),
    each checked (file_settings)."""
    if path is None:
        return
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise click.UsageError(f"--config {path}: {e.strerror or e}", ctx) from None
    except tomllib.TOMLDecodeError as e:
        raise click.UsageError(f"--config {path} is not TOML: {e}", ctx) from None
    try:
        settings = file_settings(ctx, data)
    except ValueError as e:
        raise click.UsageError(f"--config {path}: {e}", ctx) from None
    ctx.default_map = {**(ctx.default_map or {}), **settings}


def file_settings(ctx: click.Context, data: dict) -> dict:
    """{parameter name: value} from a config file's {key: value}; ValueError naming the key
    that names no option (and the keys allowed) or the value it cannot take."""
    by_key = {long_name(p): p for p in options(ctx.command)}
    out, seen = {}, {}
    for key, value in data.items():
        name = key.replace("_", "-")
        param = by_key.get(name)
        if param is None:
            allowed = ", ".join(sorted(k for k, p in by_key.items() if not p.hidden))
            raise ValueError(f"unknown key {key!r}: the keys are the options' names, with "
                             f"dashes or underscores: {allowed}")
        if name in seen:
            raise ValueError(f"keys {seen[name]!r} and {key!r} name the same option; give one")
        seen[name] = key
        out[param.name] = file_value(ctx, param, key, value)
    return out


def file_value(ctx: click.Context, param: click.Option, key: str, value):
    """The value a file gives an option, checked as the option checks its own (a range, a
    choice), after its TOML kind: ValueError naming the key, the value and what is
    allowed."""
    shown = "(hidden)" if param.name in SECRETS else repr(value)
    kind, ok = expected_kind(param)
    items = value if param.multiple and isinstance(value, list) else [value]
    if param.multiple and isinstance(value, str):
        value = [value]
    if not all(ok(v) for v in items):
        raise ValueError(f"{key} = {shown}: expected {kind}")
    try:
        param.type_cast_value(ctx, value)
    except click.BadParameter as e:
        why = "not allowed" if param.name in SECRETS else e.message
        raise ValueError(f"{key} = {shown}: {why}") from None
    return value


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def expected_kind(param: click.Option):
    """(what the option takes, as said in an error; a check of one TOML value)."""
    t = param.type
    if param.is_flag or isinstance(t, click.types.BoolParamType):
        kind, ok = "true or false", lambda v: isinstance(v, bool)
    elif isinstance(t, click.types.IntParamType):
        kind, ok = "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)
    elif isinstance(t, click.types.FloatParamType):
        kind, ok = "a number", is_number
    elif isinstance(t, click.Choice):
        kind, ok = "one of " + ", ".join(map(repr, t.choices)), lambda v: isinstance(v, str)
    elif t is click.STRING or isinstance(t, click.Path):
        kind, ok = "a string", lambda v: isinstance(v, str)
    else:  # a type of ours (--num-draft-tokens: 6 or "auto:8")
        kind, ok = f"a string or a number ({t.name})", lambda v: isinstance(v, str) or \
            is_number(v)
    if param.multiple:
        return f"a list of {kind.removeprefix('a ')}s or one string", ok
    return kind, ok


def default_text(param: click.Option) -> str:
    """An option's default as the options table shows it."""
    value = param.default
    if param.is_flag and not isinstance(value, bool):  # a plain flag: off unless given
        value = False
    if param.multiple and not isinstance(value, (list, tuple)):  # none given: none
        value = ()
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return ""
    return f"`{value}`"


def first_sentence(text: str) -> str:
    """The help's first sentence (up to a '. ' that ends no "e.g.", or the first ' [' that
    opens its default)."""
    text = re.split(r"(?<!e\.g)\. | \[", " ".join(text.split()), maxsplit=1)[0]
    return text.rstrip(".") + "."


def options_table(command: click.Command) -> str:
    """A Markdown table of the command's options: flag, environment variable, default, and
    the help's first sentence (docs/serving.md holds it; a test keeps it in sync)."""
    rows = ["| Option | Environment variable | Default | What |", "|---|---|---|---|"]
    for param in options(command):
        if param.hidden:
            continue
        flag = " / ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts]
                          if o.startswith("--"))
        what = first_sentence(param.help or "").replace("|", "\\|")  # not a cell's end
        rows.append(f"| {flag} | `{env_name(param)}` | {default_text(param)} | {what} |")
    return "\n".join(rows) + "\n"
