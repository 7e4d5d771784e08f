"""The documentation's generated tables are the code's: the settlement table, the options, the
gateway's flags, the problem types and the parameters (scripts/doc_tables.py says which)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def doc_tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_equals_the_code():
    differences = doc_tables().differences(write=False)
    assert differences == [], "run scripts/doc-tables, and fill in what it leaves empty"


def test_each_kind_of_table_is_there():
    text = "".join(page.read_text() for page in (ROOT / "docs").rglob("*.md"))
    for name in ("settlements", "options", "gateway-command", "problems"):
        assert f"<!-- table: {name} -->" in text, name
    for target in ("PostgresStore", "Reaper", "Sweeper", "BackgroundMaintenance"):
        assert f"<!-- table: parameters: idempotency_asgi.{target} -->" in text, target


def test_the_problem_table_reads_every_problem_the_code_can_answer():
    # The table is read from the Problem(...) calls in the source; each factory, called, must
    # answer one of them, with its status.
    import inspect

    from idempotency_asgi import problems
    from idempotency_asgi.gateway import problems as gateway_problems

    listed = {(name, status) for name, status, _ in doc_tables().problem_types()}
    assert len(listed) == len({name for name, _ in listed}), "a problem name used twice"
    answered = set()
    for module in (problems, gateway_problems):
        for name, factory in inspect.getmembers(module, inspect.isfunction):
            if factory.__module__ != module.__name__ or name.startswith("_"):
                continue
            arguments = {
                parameter: {
                    "reason": "r",
                    "name": "x",
                    "path": "/p",
                    "error": "e",
                    "challenge": "Bearer",
                }.get(parameter, 1)
                for parameter in inspect.signature(factory).parameters
            }
            problem = factory(**arguments)
            assert isinstance(problem, problems.Problem), name
            answered.add((problem.name, problem.status))
    assert answered == listed


def test_each_option_shows_its_default_as_python_reads_it():
    # `("Idempotent-Replayed")` is a string in Python: the page must show the tuple it is.
    import ast
    import re
    from dataclasses import fields

    from idempotency_asgi import IdempotencyConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    shown = dict(re.findall(r"^### `(\w+)`\n\n`[^\n]*?, default `([^`]+)`", page, re.MULTILINE))
    defaults = {option.name: option.default for option in fields(IdempotencyConfig)}
    assert set(shown) == set(defaults)
    for name, text in shown.items():
        if text == "DEFAULT_EXCLUDED_HEADERS":
            continue  # named, with its members listed after it
        assert ast.literal_eval(text) == defaults[name], f"{name}: the page shows {text}"
