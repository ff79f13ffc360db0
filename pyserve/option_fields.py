"""How an option is declared: a dataclass field whose metadata holds its
flags, help and choices (`option`), and the argparse arguments a group of
such fields becomes (`add_arguments`)."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import Field, field
from typing import Any, Iterable


def option(default: Any, *flags: str, help: str, choices: list[str] | None = None,
           inverse: tuple[str, str] | None = None, alias: tuple[str, dict[str, Any], str] | None = None,
           secret: bool = False, items: bool = False, spellings: dict[str, str] | None = None) -> Any:
    """An option's field with its command line. `flags` default to the
    field's name (`--max-total-tokens`). A bool field is a switch that sets
    True; `inverse` is (flag, help) of a second switch that sets False.
    `alias` is (flag, {word: value}, help): another server's flag for the
    same option, whose words name its values. A `secret` is left out of
    the options' repr (the start-up log) and of what /get_server_info
    reports. An `items` option takes one or more words (`--lora-paths a=/p
    b=/q`, SGLang's form) and holds them comma-joined, as if given `a=/p,b=/q`.
    `spellings` are other servers' names of some of its `choices` (vLLM's
    `llama3_json` for `llama3`), read on the command line as the choice they name."""
    return field(default=default, repr=not secret,
                 metadata={"flags": flags, "help": help, "choices": choices, "inverse": inverse, "alias": alias,
                           "secret": secret, "items": items, "spellings": spellings})


class _NamedValue(argparse.Action):
    """An alias's flag: stores the value its word names."""

    def __init__(self, *args, values_by_word: dict[str, Any], **kwargs):
        super().__init__(*args, choices=list(values_by_word), **kwargs)
        self.values_by_word = values_by_word

    def __call__(self, parser, namespace, word, option_string=None):
        setattr(namespace, self.dest, self.values_by_word[word])


class _CommaJoined(argparse.Action):
    """An `items` option's flag: its words, comma-joined."""

    def __call__(self, parser, namespace, words, option_string=None):
        setattr(namespace, self.dest, ",".join(words))


class _Respelled:
    """A `spellings` option's value: the choice another server's name stands for."""

    def __init__(self, spellings: dict[str, str]):
        self.spellings = spellings

    def __call__(self, word: str) -> str:
        return self.spellings.get(word, word)


def _value_type(hint: Any) -> type:
    """int for `int` and `int | None`: what argparse converts a value to."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = (t for t in typing.get_args(hint) if t is not type(None))
    return hint


def comma_list(value: str) -> list[str]:
    """The items of a comma-separated option, blanks dropped."""
    return [item.strip() for item in value.split(",") if item.strip()]


def flags_of(f: Field) -> tuple[str, ...]:
    """The command-line flags of an option's field: its own, or its name's (`--max-total-tokens`)."""
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def add_arguments(section: argparse._ArgumentGroup, options: Iterable[Field], hints: dict[str, Any]) -> None:
    """The arguments of `options` (fields made by `option`) in `section`;
    `hints`: the fields' resolved type hints."""
    for f in options:
        meta = f.metadata
        flags = flags_of(f)
        if _value_type(hints[f.name]) is bool:
            section.add_argument(*flags, dest=f.name, action="store_const", const=True, default=f.default,
                                 help=meta["help"])
            if meta["inverse"] is not None:
                flag, help = meta["inverse"]
                section.add_argument(flag, dest=f.name, action="store_const", const=False, help=help)
        elif meta["items"]:
            section.add_argument(*flags, dest=f.name, nargs="+", action=_CommaJoined, default=f.default,
                                 help=meta["help"])
        else:
            kind = _value_type(hints[f.name])
            if meta["spellings"]:  # argparse converts a value before it checks the choices
                kind = _Respelled(meta["spellings"])
            section.add_argument(*flags, dest=f.name, type=kind, default=f.default,
                                 choices=meta["choices"], help=meta["help"])
        if meta["alias"] is not None:
            flag, values_by_word, help = meta["alias"]
            section.add_argument(flag, dest=f.name, action=_NamedValue, values_by_word=values_by_word,
                                 default=argparse.SUPPRESS, help=help)
