"""One frozen config dataclass per service, read from flags and SPECDEC_* environment variables.

Each field `foo_bar` becomes the flag `--foo-bar` and the variable `SPECDEC_FOO_BAR`; a flag beats the
environment, which beats the default. Field metadata may carry `help` and `flag` (an extra alias).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "SPECDEC_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def load_config(cls: type[T], argv: Sequence[str] | None = None, description: str = "") -> T:
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description or cls.__doc__)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    for f in fields:
        kind = _base_type(hints[f.name])
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]
        help_text = f"{f.metadata.get('help', '')} (env {env_name(f.name)})"
        if kind is bool:
            parser.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(*flags, dest=f.name, type=str, default=None, help=help_text)
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for f in fields:
        raw = args[f.name]
        if raw is None:
            raw = os.environ.get(env_name(f.name))
        if raw is not None:
            values[f.name] = _convert(raw, hints[f.name], f.name)
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; `tuple[str, ...]` -> tuple."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _base_type(args[0])
    return origin or hint


def _convert(raw: Any, hint: Any, name: str) -> Any:
    kind = _base_type(hint)
    if not isinstance(raw, str):
        return raw
    if raw == "" and type(None) in typing.get_args(hint):
        return None
    try:
        if kind is bool:
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes", "on")
        if kind is tuple:
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        return kind(raw)
    except ValueError:
        raise SystemExit(f"invalid value {raw!r} for {name} ({env_name(name)} / --{name.replace('_', '-')})") from None
