"""The documentation's tables that the code decides, kept equal to it.

Each lies in a page between `<!-- table: NAME -->` and `<!-- /table -->`:

- `settlements` (contract.md): every way a keyed request ends, from `_asgi/settlement.py`;
- `options` (configuration.md): every field of `IdempotencyConfig`, one heading each, with its
  type, its default (the middleware's and the gateway's), its flag and variable, and its help,
  from the field itself;
- `gateway-command` (gateway.md): every flag of `idempotency-asgi gateway`, from its options;
- `problems` (contract.md): every problem type, its `code` member, its status from the code
  that answers it, and what it means (written by hand: the check wants one line for each, no
  more, no fewer);
- `parameters: MODULE.NAME` (several pages): a callable's parameters, their types and defaults
  from its signature, what each does written by hand.

`python scripts/doc_tables.py` rewrites them in place (a new parameter or problem gets an empty
description to fill in); `--check` only compares, and tests/test_docs_tables.py runs it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

BLOCK = re.compile(r"(<!-- table: ([^>]+?) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def code(text: str) -> str:
    """Inline code for a table cell; a union's `|` would end the cell, so it reads "or"."""
    return " or ".join(f"`{part.strip()}`" for part in text.split(" | "))


def value_text(value: Any) -> str:
    from idempotency_asgi import DEFAULT_EXCLUDED_HEADERS

    if value is DEFAULT_EXCLUDED_HEADERS:
        return "`DEFAULT_EXCLUDED_HEADERS`: " + ", ".join(sorted(value))
    if isinstance(value, (set, frozenset)):
        return "`{" + ", ".join(str(item) for item in sorted(value, key=str)) + "}`"
    if isinstance(value, tuple):
        # As Python writes it: a one-item tuple keeps its comma, or it reads as a string.
        return "`" + repr(value).replace("'", '"') + "`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        if value % (1024 * 1024) == 0:
            return f"`{value}` ({value // (1024 * 1024)} MiB)"
        if value % 1024 == 0:
            return f"`{value}` ({value // 1024} KiB)"
        return f"`{value:_}`"
    return f"`{value!r}`".replace("'", '"')


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


# -- the tables ---------------------------------------------------------------------------------


def settlements(_: str) -> str:
    from idempotency_asgi._asgi.settlement import markdown_table

    return markdown_table()


def options(_: str) -> str:
    """One entry per option, a heading each (a link can name it: `configuration.md#ttl_seconds`):
    its type and default, the gateway's default, the command's flag and variable, its help."""
    from idempotency_asgi import IdempotencyConfig
    from idempotency_asgi.gateway import build_gateway

    gateway = inspect.signature(build_gateway).parameters["config"].default
    entries = []
    for option in fields(IdempotencyConfig):
        default = option.default
        assert default is not MISSING
        flag = "--" + option.name.replace("_", "-")
        if "env" not in option.metadata:  # an application's only, with no flag
            in_gateway = "not in the gateway."
        else:
            gateway_default = getattr(gateway, option.name)
            same = gateway_default == default
            in_gateway = "in the gateway: " + ("the same" if same else value_text(gateway_default))
            in_gateway += f" (`{flag}`, `{option.metadata['env']}`)."
        help_text = option.metadata["help"]
        entries.append(
            f"### `{option.name}`\n\n"
            f"{code(str(option.type))}, default {value_text(default)}; {in_gateway}\n\n"
            f"{help_text[:1].upper()}{help_text[1:]}.\n"
        )
    return "\n".join(entries)


def gateway_command(_: str) -> str:
    from idempotency_asgi.gateway.options import OPTIONS

    lines = [row("flag", "variable", "default", "what it sets"), row(*["---"] * 4)]
    for option in OPTIONS:
        if option.switch:
            flag = f"`{option.flag}`, `--no-{option.flag[2:]}`"
            default = "on" if option.default == "1" else "off"
        else:
            flag = f"`{option.flag}`"
            default = f"`{option.default}`" if option.default else "none"
            if option.field in ("upstream", "database_url"):
                default = "required"
        lines.append(row(flag, f"`{option.env}`", default, option.help))
    return "\n".join(lines) + "\n"


def described(existing: str) -> dict[str, str]:
    """The hand-written last column of a table, by the first column's name."""
    found: dict[str, str] = {}
    for line in existing.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) >= 2:
            found[cells[0].strip("`")] = cells[-1]
    return found


def problem_types() -> list[tuple[str, int, str]]:
    """(name, status, where) for every problem the package answers with."""
    found = []
    for path in sorted((ROOT / "idempotency_asgi").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Problem"
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[1], ast.Constant)
            ):
                where = "gateway" if "gateway" in path.parts else "middleware"
                found.append((node.args[1].value, node.args[0].value, where))
    return sorted(found, key=lambda problem: problem[2] == "gateway")  # the middleware's first


def problems(existing: str) -> str:
    from idempotency_asgi.problems import PROFILE_CODES

    descriptions = described(existing)
    lines = [row("type", "code", "status", "from", "what it means"), row(*["---"] * 5)]
    for name, status, where in problem_types():
        code = PROFILE_CODES.get(name, name)
        lines.append(row(f"`{name}`", f"`{code}`", str(status), where, descriptions.get(name, "")))
    return "\n".join(lines) + "\n"


def parameters(target: str, existing: str) -> str:
    module, _, name = target.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    descriptions = described(existing)
    lines = [row("parameter", "type", "default", "what it does"), row(*["---"] * 4)]
    for parameter in inspect.signature(obj).parameters.values():
        if parameter.name in ("self", "transport") or parameter.kind is parameter.VAR_KEYWORD:
            continue
        annotation = parameter.annotation
        type_text = code(annotation if isinstance(annotation, str) else annotation.__name__)
        default = (
            "required" if parameter.default is parameter.empty else value_text(parameter.default)
        )
        if parameter.name == "config" and default != "required":
            default = "the gateway's (below)" if module.endswith("gateway") else default
        lines.append(
            row(f"`{parameter.name}`", type_text, default, descriptions.get(parameter.name, ""))
        )
    return "\n".join(lines) + "\n"


def render(name: str, existing: str) -> str:
    if name.startswith("parameters: "):
        return parameters(name.removeprefix("parameters: "), existing)
    tables = {
        "settlements": settlements,
        "options": options,
        "gateway-command": gateway_command,
        "problems": problems,
    }
    return tables[name](existing)


def differences(write: bool) -> list[str]:
    """What differs from the code (rewritten first when `write`); empty when all is equal."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()

        def replace(match: re.Match[str], page: Path = page) -> str:
            wanted = render(match.group(2), match.group(3))
            if wanted != match.group(3):
                found.append(f"{page.relative_to(ROOT)}: table {match.group(2)!r}")
            for line in wanted.splitlines()[2:]:
                if line.endswith("|  |"):
                    found.append(f"{page.relative_to(ROOT)}: {match.group(2)!r}: {line[:60]}")
            return match.group(1) + wanted + match.group(4)

        new = BLOCK.sub(replace, text)
        if write and new != text:
            page.write_text(new)
    return found


def main() -> int:
    check = "--check" in sys.argv[1:]
    found = differences(write=not check)
    for line in found:
        print(("differs: " if check else "rewritten or to fill in: ") + line, file=sys.stderr)
    return 1 if check and found else 0


if __name__ == "__main__":
    sys.exit(main())
