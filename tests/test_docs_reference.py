"""The API reference is generated from the code: each of IdempotencyConfig's fields is listed
there with its help and its default (docs/griffe_options.py gives them to mkdocstrings)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import griffe

from idempotency_asgi import IdempotencyConfig

ROOT = Path(__file__).resolve().parent.parent


def reference_class() -> griffe.Class:
    extensions = griffe.load_extensions(str(ROOT / "docs" / "griffe_options.py") + ":OptionFields")
    package = griffe.load("idempotency_asgi", search_paths=[str(ROOT)], extensions=extensions)
    found = package["_asgi.config.IdempotencyConfig"]
    assert isinstance(found, griffe.Class)
    return found


def test_the_reference_lists_every_field_with_its_help_and_default():
    listed = reference_class()
    for option in fields(IdempotencyConfig):
        member = listed.members.get(option.name)
        assert member is not None, f"{option.name} is not in the reference"
        help_text = option.metadata["help"]
        assert member.docstring is not None, f"{option.name} has no text in the reference"
        assert member.docstring.value == help_text[:1].upper() + help_text[1:] + "."
        shown = str(member.value)
        if not shown.startswith("DEFAULT_"):
            # Literals, and products such as 1024 * 1024.
            value = eval(compile(ast.parse(shown, mode="eval"), "reference", "eval"), {})
            assert value == option.default, f"{option.name}: the reference shows {shown}"
