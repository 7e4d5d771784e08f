"""A griffe extension for the API reference: the fields of `IdempotencyConfig` are declared as
`name: type = _option(default, env=..., parse=..., help="...")`, or, for those only an
application can set, `field(default=..., metadata={"help": "..."})`, which mkdocstrings would
show as fields with no text and a call for their value. This gives each field its help as its
docstring and its default as its value, so the reference lists every field as Configuration
does, from the same source (tests/test_docs_reference.py checks each one)."""

from __future__ import annotations

import ast
from typing import Any

from griffe import Attribute, Docstring, Extension


class OptionFields(Extension):
    def on_attribute_instance(self, *, node: ast.AST | Any, attr: Attribute, **_: Any) -> None:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.value, ast.Call):
            return
        call = node.value
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        function = getattr(call.func, "id", None)
        if function == "_option" and call.args:
            default, help_node = call.args[0], keywords.get("help")
        elif function == "field" and "default" in keywords:
            default, help_node = keywords["default"], None
            metadata = keywords.get("metadata")
            if isinstance(metadata, ast.Dict):
                for key, value in zip(metadata.keys, metadata.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "help":
                        help_node = value
        else:
            return
        text = _text(help_node)
        if text:
            attr.docstring = Docstring(text[:1].upper() + text[1:] + ".", parent=attr)
        attr.value = ast.unparse(default)


def _text(node: ast.AST | None) -> str:
    """A help text as written: a literal, or literals joined by implicit concatenation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""
