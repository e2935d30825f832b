"""The configuration reference, generated from the config models themselves.

`render()` walks `dilonode.config.RunConfig`: the run's own fields first, then one section
per component model (`[model]`, `[data]`, ...; a model nested in a component gets its own
`[a.b]` section), each a table of field, type (with its bounds), default and description,
the description taken from `Field(description=...)` or else the docstring under the field.
docs/configuration.md is this output, so the page cannot drift from the code:

    python -m dilonode.cli.config_doc > docs/configuration.md    # or --write
    python -m dilonode.cli.config_doc --check                     # exit 1 when it differs

`undocumented()` lists the fields that have no description (tests/unit/test_config_doc.py
requires none).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, TypeGuard

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dilonode.config import RunConfig

__all__ = ["DEFAULT_PATH", "main", "models", "render", "undocumented"]

DEFAULT_PATH = Path("docs/configuration.md")

_HEADER = """\
# Configuration reference

<!-- Generated from dilonode/config.py; do not edit by hand. Regenerate with
     `python -m dilonode.cli.config_doc --write` (`--check` tells whether it is current). -->

Generated from the config models in `dilonode/config.py`: regenerate this page with
`python -m dilonode.cli.config_doc --write` (or `> docs/configuration.md`) after changing a
field. A run reads one TOML file (`--config`; examples in `configs/`), whose tables are the
sections below, and `--set section.field=value` overrides any field
(`--set diloco.sync_every=50`). Every model is frozen and refuses unknown fields; a bad value
stops the program with one line naming the field, the value and the rule.
"""

# The attributes of pydantic's bound metadata (annotated_types.Ge, Gt, Le, Lt).
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def models(root: type[BaseModel] = RunConfig,
           prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(TOML section, model) for `root` (section "") and every model nested in it, in field
    order: a component's nested models follow it."""
    yield prefix, root
    for name, field in root.model_fields.items():
        if _is_model(field.annotation):
            yield from models(field.annotation, f"{prefix}.{name}" if prefix else name)


def _attribute_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the string literal right below its annotated assignment."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(model)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _description(model: type[BaseModel], name: str, field: FieldInfo) -> str | None:
    if field.description:
        return " ".join(field.description.split())
    doc = _attribute_docstrings(model).get(name)
    return " ".join(doc.split()) if doc else None


def undocumented(root: type[BaseModel] = RunConfig) -> list[str]:
    """`section.field` of every field, of `root` and the models in it, with no description."""
    missing = []
    for section, model in models(root):
        for name, field in model.model_fields.items():
            if not _is_model(field.annotation) and _description(model, name, field) is None:
                missing.append(f"{section}.{name}" if section else name)
    return missing


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if annotation is type(None):
        return "none"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for attr, sign in _BOUNDS:
            if (bound := getattr(item, attr, None)) is not None:
                found.append(f"{sign} {_value(bound)}")
    return ", ".join(found)


def _value(value: Any) -> str:
    """A value as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(value)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "required" if field.default_factory is None else "(computed)"
    return "unset" if field.default is None else _value(field.default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section(section: str, model: type[BaseModel]) -> list[str]:
    title = f"`[{section}]`" if section else "Top level"
    lines = [f"## {title}: `{model.__name__}`", ""]
    if model.__doc__:
        lines += [" ".join(p.split()) + "\n" for p in inspect.cleandoc(model.__doc__).split("\n\n")]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if _is_model(field.annotation):
            continue
        kind = _type_name(field.annotation)
        if bounds := _bounds(field):
            kind += f", {bounds}"
        desc = _description(model, name, field) or "(no description)"
        lines.append(f"| `{name}` | {_cell(kind)} | `{_cell(_default(field))}` | {_cell(desc)} |")
    return lines + [""]


def render() -> str:
    """The whole reference page, Markdown, ending in one newline."""
    entries = list(models())
    index = ", ".join(f"[`[{s}]`](#{s.replace('.', '')}-{m.__name__.lower()})"
                      for s, m in entries if s)
    lines = [_HEADER, f"Sections: top level, {index}.", ""]
    for section, model in entries:
        lines += _section(section, model)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the page, write it (`--write`) or compare it with the file (`--check`)."""
    parser = argparse.ArgumentParser(prog="python -m dilonode.cli.config_doc",
                                     description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the page to --path")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when --path differs from the generated page")
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH,
                        help=f"the page (default: {DEFAULT_PATH}, from the repository root)")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        args.path.write_text(page)
    elif args.check:
        current = args.path.read_text() if args.path.exists() else ""
        if current != page:
            print(f"{args.path} is out of date: run python -m dilonode.cli.config_doc --write",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
