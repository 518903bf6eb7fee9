"""How a config dataclass's fields are named outside it: each field is an option (a CLI flag, an
`LLM` keyword, an HTTP field) under its own name, or under a public name it declares once with
`option`. Commands build their configs from their options through these, renaming nothing by
hand. Torch-free and import-free: every part of the package may use it."""

from __future__ import annotations

import dataclasses
from dataclasses import field


def option(default, name: str):
    """A config field whose public name (its CLI flag, `LLM` keyword, HTTP field) is not the
    field's own, declared once, here: from_options takes either name."""
    return field(default=default, metadata={"option": name})


def option_names(cls) -> dict[str, str]:
    """{public name: field name} of a config dataclass's fields; a field without a declared
    option name is public under its own."""
    return {f.metadata.get("option", f.name): f.name for f in dataclasses.fields(cls)}


def defaults(cls) -> dict:
    """{field name: default} of a config dataclass's fields that have one: what the command
    line shows, read from the one place it is set."""
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def field_options(cls, options: dict, aliases: bool = True) -> dict:
    """The entries of `options` that name a field of `cls` by its public name (or, with
    aliases, by the field's own), keyed by field name. ValueError where both of a field's
    names are given and disagree."""
    out = {}
    for public, name in option_names(cls).items():
        names = dict.fromkeys((public, name) if aliases else (public,))
        given = {n: options[n] for n in names if n in options}
        if len(set(map(repr, given.values()))) > 1:
            raise ValueError(" and ".join(f"{n}={v!r}" for n, v in given.items())
                             + " disagree; give one")
        if given:
            out[name] = next(iter(given.values()))
    return out


def from_options(cls, options: dict, **fields):
    """cls built from a command's options: each entry named by a field's public name (a
    command's options may fill several configs, and two configs may have fields of one name);
    `fields` by field name; the rest keep their defaults."""
    return cls(**field_options(cls, options, aliases=False), **fields)
