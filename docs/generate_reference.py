"""Write docs/reference/ from the code: every config key (type, default, comment, choices) from the dataclasses
in src/steadydiff/config.py, and every command's --help from the CLI's parser.

    python docs/generate_reference.py            # rewrite docs/reference/config.md and cli.md
    python docs/generate_reference.py --check    # exit 1 if they are stale (tests/test_docs.py does this)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import sys
import tokenize
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "reference"


def _field_comments(source: str) -> dict[tuple[str, str], str]:
    """{(class name, field name): its comment}: the `# ...` at the end of the field's line, after any comment
    lines directly above it."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, row = [], stmt.lineno - 1
                while row >= 1 and lines[row - 1].strip().startswith("#"):
                    above.insert(0, comments[row])
                    row -= 1
                parts = above + ([comments[stmt.lineno]] if stmt.lineno in comments else [])
                out[node.name, stmt.target.id] = " ".join(p for p in parts if p)
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return "null" if value is None else repr(value).replace("'", "")


def _type(tp) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def config_reference() -> str:
    from steadydiff import config
    from steadydiff.cli import build_parser
    from steadydiff.utils.registry import registries_for

    build_parser()  # loads every registry, so registered keys list their choices
    comments = _field_comments(inspect.getsource(config))
    hints = typing.get_type_hints(config.Config)
    lines = ["# Config reference", "",
             "Every key a config file or `--set section.key=value` accepts, generated from the dataclasses in",
             "`src/steadydiff/config.py` by `docs/generate_reference.py` (a test fails when this page is stale).",
             "A key marked *resumable* may change when a run is resumed (it does not alter the trajectory); any",
             "other key must equal the run directory's `config.yaml`.", ""]
    for section in dataclasses.fields(config.Config):
        cls = hints[section.name]
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        lines += [f"## `{section.name}`", ""] + ([doc, ""] if doc and not doc.startswith(cls.__name__ + "(") else [])
        lines += ["| key | type | default | what |", "|---|---|---|---|"]
        sub_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            what = comments.get((cls.__name__, f.name), "")
            choices = [n for r in registries_for(key) for n in r.names]
            if typing.get_origin(sub_hints[f.name]) is typing.Literal:
                choices = list(typing.get_args(sub_hints[f.name]))
            if choices:
                what += ("; " if what else "") + "one of: " + ", ".join(f"`{c}`" for c in dict.fromkeys(choices))
            if f.metadata.get("resumable") or section.metadata.get("resumable"):
                what += " *(resumable)*"
            typ = "str" if choices and typing.get_origin(sub_hints[f.name]) is typing.Literal else _type(sub_hints[f.name])
            typ = typ.replace(" | ", " or ").replace("NoneType", "null")
            lines.append(f"| `{key}` | {typ} | `{_default(f)}` | {what.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def _subparsers(parser: argparse.ArgumentParser, prefix: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _subparsers(sub, f"{prefix} {name}")


def cli_reference() -> str:
    os.environ["COLUMNS"] = "110"  # argparse wraps help at the terminal width: fixed here, so the page is stable
    from steadydiff.cli import build_parser

    parser = build_parser()
    lines = ["# Command reference", "",
             "Every `steadydiff` command's `--help`, generated by `docs/generate_reference.py` from the CLI's",
             "parser (a test fails when this page is stale). Choice lists come from the registries.", "",
             "```", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subparsers(parser, "steadydiff"):
        lines += [f"## `{name}`", "", "```", sub.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


PAGES = {"config.md": config_reference, "cli.md": cli_reference}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated page differs from the committed one")
    args = ap.parse_args(argv)
    stale = []
    for name, make in PAGES.items():
        text = make()
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python docs/generate_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
