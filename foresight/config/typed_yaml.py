"""Typed settings from YAML: a mapping filled into nested dataclasses field by field, each value coerced to its
field's type with an error naming the field (``section.field``), and YAML read as recipes mean it (no base-60 numbers).
Generic over the dataclasses: :mod:`foresight.config.recipe` holds the recipe's sections and applies ``--set`` overrides."""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import yaml

from foresight.config.checks import RecipeError


def coerce(value, tp, where: str):
    """``value`` as the type ``tp`` (optional, list, bool, int, float, str); ``where`` names the field in errors."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(value, inner[0], where)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, args[0], where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise RecipeError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise RecipeError(f"{where}: expected an integer, got {value!r}") from None
        if not math.isfinite(f) or f != int(f):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise RecipeError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(f):
            raise RecipeError(f"{where}: expected a finite number, got {value!r}")
        return f
    if tp is str:
        if value is None:
            raise RecipeError(f"{where}: expected a string, got null")
        return str(value)
    return value


def fill(obj, data: dict, where: str):
    """Set the fields of the dataclass ``obj`` (recursively) from the mapping ``data``; an unknown key is an error."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where or 'the recipe'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        if key not in names:
            raise RecipeError(f"unknown recipe field '{where}.{key}' (known: {', '.join(sorted(names))})".replace("'.", "'"))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            fill(getattr(obj, key), value, f"{where}.{key}" if where else key)
        else:
            setattr(obj, key, coerce(value, tp, f"{where}.{key}" if where else key))


class RecipeLoader(yaml.SafeLoader):
    """YAML as recipes mean it: no YAML 1.1 base-60 numbers, so ``256:32`` (a budget) stays the string it reads as
    instead of the integer 15392; every other scalar resolves as with ``yaml.safe_load``."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"^(?!.*:)" + rx.pattern.lstrip("^"), rx.flags) if tag.endswith((":int", ":float")) else rx)
            for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def read_yaml(text: str):
    return yaml.load(text, Loader=RecipeLoader)
