"""HyperPyYAML files read as data: `!new:`/`!name:`/`!apply:` become `Tagged`, `!ref` is resolved.

Nothing named in a tag is imported or executed; an engine maps each tag's target to its own
module and reads the arguments as sizes.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mizuoto.errors import ModelLoadError

_REF = re.compile(r"<([^<>]+)>")


@dataclass
class Tagged:
    """A `!kind:target` node: kind is new|name|apply, target the dotted name, args its body."""

    kind: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)

    @property
    def cls(self) -> str:
        """The last component of the target ("cosyvoice.llm.llm.Qwen2LM" -> "Qwen2LM")."""
        return self.target.rsplit(".", 1)[-1]

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]

    def get(self, key: str, default: Any = None) -> Any:
        """A keyword argument, or default."""
        return self.kwargs.get(key, default)


@dataclass
class _Ref:
    expr: str


class _Loader(yaml.SafeLoader):
    pass


# YAML 1.1 reads "1e-06" as a string; HyperPyYAML (ruamel, YAML 1.2) reads it as a float.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _tag_constructor(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    kind, _, target = suffix.partition(":")
    if isinstance(node, yaml.MappingNode):
        return Tagged(kind, target, kwargs=loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Tagged(kind, target, args=loader.construct_sequence(node, deep=True))
    value = loader.construct_scalar(node)
    return Tagged(kind, target, args=[] if value in ("", None) else [value])


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", lambda l, s, n, k=_kind: _tag_constructor(l, f"{k}:{s}", n))
_Loader.add_constructor("!ref", lambda loader, node: _Ref(str(loader.construct_scalar(node))))

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.USub: operator.neg}


def _arith(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError("only arithmetic on numbers is allowed in a !ref expression")


def _lookup(root: dict, path: str) -> Any:
    parts = re.findall(r"[^\[\]]+", path)
    value: Any = root
    for part in parts:
        value = value[part] if not isinstance(value, Tagged) else value.kwargs[part]
    return value


def _resolve(value: Any, root: dict, where: str, stack: tuple[str, ...] = ()) -> Any:
    if isinstance(value, _Ref):
        refs = _REF.findall(value.expr)
        if not refs:
            raise ModelLoadError(f"{where}: !ref without <name>: {value.expr!r}")
        resolved = {}
        for name in refs:
            if name in stack:
                raise ModelLoadError(f"{where}: circular !ref <{name}>")
            try:
                target = _lookup(root, name)
            except (KeyError, TypeError):
                raise ModelLoadError(f"{where}: !ref <{name}> names nothing in the file") from None
            resolved[name] = _resolve(target, root, name, stack + (name,))
        if _REF.fullmatch(value.expr.strip()):
            return resolved[refs[0]]
        text = _REF.sub(lambda m: repr(resolved[m.group(1)]), value.expr)
        try:
            return _arith(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError) as exc:
            raise ModelLoadError(f"{where}: cannot evaluate !ref {value.expr!r}: {exc}") from None
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target,
                      {k: _resolve(v, root, f"{where}.{k}", stack) for k, v in value.kwargs.items()},
                      [_resolve(v, root, where, stack) for v in value.args])
    if isinstance(value, dict):
        return {k: _resolve(v, root, f"{where}.{k}" if where else str(k), stack) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root, where, stack) for v in value]
    return value


def load_hyperyaml(path: str | Path) -> dict[str, Any]:
    """Parse a HyperPyYAML file into plain data with `Tagged` nodes and every `!ref` resolved."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ModelLoadError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a mapping at the top level")
    return _resolve(raw, raw, "")
