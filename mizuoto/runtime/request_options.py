"""Request options an engine declares beyond the common fields (name, type, range, default, help).

An engine lists them in its `Capabilities.options`; the runtime checks a request's `options` against
them before any work (`resolve_options`) and hands the engine every option filled in, so the engine
reads `request.options[name]` and never validates. The CLI (`--option name=value`), the HTTP API
and its OpenAPI document, the web page and Wyoming expose them from these declarations alone.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mizuoto.errors import InvalidRequest, quoted

OPTION_TYPES = ("float", "int", "bool", "str")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_JSON_TYPES = {"float": "number", "int": "integer", "bool": "boolean", "str": "string"}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
NAMED = 3  # unknown option names an error lists (a request may send thousands)


@dataclass(frozen=True)
class RequestOption:
    """One engine-specific request setting: its value is checked (type, range, choices) by the runtime."""

    name: str
    type: str  # one of OPTION_TYPES
    default: Any
    help: str = ""
    minimum: float | None = None  # inclusive bounds of a number
    maximum: float | None = None
    choices: tuple[str, ...] = ()  # the allowed values of a string (empty: any)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidRequest(f"request option name must be lower-case letters, digits and '_', got {self.name!r}")
        if self.type not in OPTION_TYPES:
            raise InvalidRequest(f"request option {self.name!r}: type must be one of {', '.join(OPTION_TYPES)}")
        if (self.minimum is not None or self.maximum is not None) and self.type not in ("float", "int"):
            raise InvalidRequest(f"request option {self.name!r}: only numbers take a range")
        if self.choices and self.type != "str":
            raise InvalidRequest(f"request option {self.name!r}: only strings take choices")
        try:
            object.__setattr__(self, "default", self.check(self.default))
        except InvalidRequest as e:
            raise InvalidRequest(f"request option {self.name!r}: its default is not a valid value ({e})") from None

    def check(self, value: Any) -> Any:
        """The value as the engine gets it (an int given for a float becomes a float); InvalidRequest if it is not one."""
        kind = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}[self.type]
        if self.type == "bool":
            ok = isinstance(value, bool)
        elif self.type == "str":
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, int) or (self.type == "float" and isinstance(value, float) and math.isfinite(value))
            ok = ok and not isinstance(value, bool)
        if not ok:
            raise InvalidRequest(f"option {self.name!r} must be {kind}{self._range()}, got {quoted(value)}",
                                 field="options")
        if self.type == "float":
            value = float(value)
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            raise InvalidRequest(f"option {self.name!r} must be {kind}{self._range()}, got {quoted(value)}",
                                 field="options")
        if self.choices and value not in self.choices:
            raise InvalidRequest(f"option {self.name!r} must be one of {', '.join(self.choices)}, got {quoted(value)}",
                                 field="options")
        return value

    def parse(self, text: str) -> Any:
        """The value of a textual setting (a command line, a form field), checked."""
        text = text.strip()
        try:
            if self.type == "bool":
                if text.lower() not in _TRUE + _FALSE:
                    raise ValueError(text)
                return self.check(text.lower() in _TRUE)
            if self.type == "int":
                return self.check(int(text))
            if self.type == "float":
                return self.check(float(text))
        except ValueError:
            kind = {"float": "a number", "int": "an integer", "bool": "true or false"}[self.type]
            raise InvalidRequest(f"option {self.name!r} must be {kind}{self._range()}, got {quoted(text)}",
                                 field="options") from None
        return self.check(text)

    def _range(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f" in [{self.minimum:g}, {self.maximum:g}]"
        if self.minimum is not None:
            return f" >= {self.minimum:g}"
        if self.maximum is not None:
            return f" <= {self.maximum:g}"
        return ""

    def schema(self) -> dict:
        """The option as a JSON schema (OpenAPI's dialect)."""
        out: dict[str, Any] = {"type": _JSON_TYPES[self.type], "default": self.default}
        if self.help:
            out["description"] = self.help
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.choices:
            out["enum"] = list(self.choices)
        return out

    def describe(self) -> str:
        """One line for a listing: name, type and range, default, help."""
        values = f" ({'|'.join(self.choices)})" if self.choices else self._range()
        return f"{self.name}: {self.type}{values}, default {self.default!r}" + (f"; {self.help}" if self.help else "")


def check_declared(options: Any) -> tuple[RequestOption, ...]:
    """A model's declared options as a tuple, each a RequestOption with a name of its own."""
    options = tuple(options)
    for o in options:
        if not isinstance(o, RequestOption):
            raise InvalidRequest(f"capabilities: options must be RequestOption, got {type(o).__name__}")
    names = [o.name for o in options]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequest(f"capabilities: options declared twice: {', '.join(twice)}")
    return options


def check_given(options: Any) -> dict[str, Any]:
    """A request's options as a dict of str keys (their values are checked against the model later)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise InvalidRequest(f"options must be a mapping of option names to values, got {type(options).__name__}",
                             field="options")
    return dict(options)


def resolve_options(declared: tuple[RequestOption, ...], given: Mapping[str, Any], name: str = "model") -> dict:
    """Every declared option's value for a request: the given ones checked, the others their defaults."""
    known = {o.name: o for o in declared}
    unknown = [k for k in given if k not in known]
    if unknown:
        listed = ", ".join(sorted(known)) if known else "none"
        named = ", ".join(quoted(k) for k in heapq.nsmallest(NAMED, unknown))
        more = f" and {len(unknown) - NAMED} more" if len(unknown) > NAMED else ""
        raise InvalidRequest(f"{name} has no option {named}{more}; its options: {listed}", field="options")
    return {o.name: o.check(given[o.name]) if o.name in given else o.default for o in declared}


def parse_settings(declared: tuple[RequestOption, ...], settings: list[str] | tuple[str, ...],
                   name: str = "model") -> dict:
    """Options from `name=value` strings (the command line's --option), each parsed by its declared type."""
    known = {o.name: o for o in declared}
    out = {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        key = key.strip()
        if not eq:
            raise InvalidRequest(f"an option is given as name=value, got {setting!r}", field="options")
        if key not in known:
            listed = ", ".join(sorted(known)) if known else "none"
            raise InvalidRequest(f"{name} has no option {quoted(key)}; its options: {listed}", field="options")
        out[key] = known[key].parse(value)
    return out
