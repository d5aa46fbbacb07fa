"""Command lines made from settings models, so that each setting is declared once: its field.

Every field of a service's pydantic settings model is one flag, named after the field in kebab
case (``max_inflight_requests``: ``--max-inflight-requests``), its help the field's docstring
(``use_attribute_docstrings``) followed by the model's default. By the field's type:

- ``bool``: ``--x`` and ``--no-x``;
- a list or tuple: the flag repeats, one item each time;
- a dict: the flag repeats, one ``KEY=VALUE`` item each time;
- ``X | None``: the word ``none`` gives None;
- anything else: one value.

The parser leaves values as text: the model converts and validates what was given (a flag left
out takes the model's default, so a default is never written twice), and a value it refuses
ends the process with status 2 and a line naming the flag, as argparse does. Old spellings of a flag stay
accepted through the ``aliases`` table each service keeps next to its model.
"""

from __future__ import annotations

import argparse
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, NoReturn, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

SettingsT = TypeVar("SettingsT", bound=BaseModel)

NONE_WORD = "none"
"""What an optional setting takes on the command line for None."""


def flag_name(field: str) -> str:
    """The flag of settings field ``field``: ``max_inflight_requests`` is
    ``--max-inflight-requests``."""
    return "--" + field.replace("_", "-")


def _none_or_text(value: str) -> str | None:
    return None if value.lower() == NONE_WORD else value


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"expects NAME=VALUE, got {item!r}")
    return key, value


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    """``annotation`` without its ``None`` member, and whether it had one."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(members) == 1 < len(get_args(annotation)):
            return members[0], True
    return annotation, False


def _help(field: FieldInfo) -> str:
    """The field's docstring on one line, without reStructuredText's quotes, and its default."""
    text = re.sub(r"\s+", " ", field.description or "").replace("``", "").strip()
    # A default made by a factory is the docstring's to describe; an empty list goes without saying.
    if not field.is_required() and field.default_factory is None and field.default not in ((), []):
        text += f" (default: {NONE_WORD if field.default is None else field.default})"
    # argparse formats help with %: a literal one is written twice.
    return text.replace("%", "%%")


class SettingsCli(Generic[SettingsT]):
    """The command line of settings model ``model``: ``parse`` reads one into the model."""

    def __init__(
        self,
        model: type[SettingsT],
        *,
        prog: str,
        description: str,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        """``aliases``: old flag spelling -> the field it sets."""
        aliases = dict(aliases or {})
        unknown = set(aliases.values()) - set(model.model_fields)
        if unknown:
            raise ValueError(f"aliases of no field of {model.__name__}: {sorted(unknown)}")
        self.model = model
        self.parser = argparse.ArgumentParser(
            prog=prog, description=description, argument_default=argparse.SUPPRESS
        )
        self._dicts: set[str] = set()
        for name, field in model.model_fields.items():
            old = [spelling for spelling, target in aliases.items() if target == name]
            self._add(name, field, old)

    def _add(self, name: str, field: FieldInfo, old_spellings: list[str]) -> None:
        flags = [flag_name(name), *old_spellings]
        kwargs: dict[str, Any] = {"dest": name, "help": _help(field)}
        annotation, optional = _strip_none(field.annotation)
        origin = get_origin(annotation)
        if annotation is bool:
            self.parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            return
        kwargs["required"] = field.is_required()
        if origin is dict:
            self._dicts.add(name)
            kwargs.update(action="append", type=_key_value, metavar="NAME=VALUE")
        elif origin in (list, tuple):
            kwargs.update(action="append", metavar="ITEM")
        elif origin is Literal:
            kwargs["metavar"] = "{" + ",".join(str(choice) for choice in get_args(annotation)) + "}"
        elif isinstance(annotation, type):
            kwargs["metavar"] = "TEXT" if annotation is str else annotation.__name__.upper()
        if optional:
            kwargs["type"] = _none_or_text
        self.parser.add_argument(*flags, **kwargs)

    def values(self, argv: Sequence[str] | None = None) -> dict[str, Any]:
        """The settings ``argv`` gives, by field name, as text: the fields it leaves out are
        absent (the model's defaults apply)."""
        given = vars(self.parser.parse_args(argv))
        for name in self._dicts & given.keys():
            given[name] = dict(given[name])
        return given

    def settings(self, values: Mapping[str, Any]) -> SettingsT:
        """The model over ``values``; a value it refuses ends the process (``fail``)."""
        try:
            return self.model(**values)
        except ValidationError as exc:
            self.fail("; ".join(_describe(error) for error in exc.errors()))

    def parse(self, argv: Sequence[str] | None = None) -> SettingsT:
        return self.settings(self.values(argv))

    def fail(self, message: str) -> NoReturn:
        """End the process as argparse does on a bad value: status 2 and one line."""
        self.parser.exit(2, f"{self.parser.prog}: error: {message}\n")


def _describe(error: ErrorDetails) -> str:
    """One validation error, naming the flag of the field it is about."""
    loc = error["loc"]
    if not loc:  # the model's own check, over several fields: its message names them
        return error["msg"].removeprefix("Value error, ")
    given = error.get("input")
    shown = f" (got {given!r})" if isinstance(given, str) else ""
    return f"argument {flag_name(str(loc[0]))}: {error['msg']}{shown}"
