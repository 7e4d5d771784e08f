"""A griffe extension for the API reference: the fields of `IdempotencyConfig` are declared as
`name: type = _option(default, env=..., parse=..., help="...")`, which mkdocstrings would show
as fields with no text and a call for their value. This gives each field its help as its
docstring and its default as its value, so the reference lists every field as Configuration
does, from the same source."""

from __future__ import annotations

import ast
from typing import Any

from griffe import Attribute, Docstring, Extension


class OptionFields(Extension):
    def on_attribute_instance(self, *, node: ast.AST | Any, attr: Attribute, **_: Any) -> None:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.value, ast.Call):
            return
        call = node.value
        if getattr(call.func, "id", None) != "_option" or not call.args:
            return
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        help_node = keywords.get("help")
        if isinstance(help_node, ast.Constant) and isinstance(help_node.value, str):
            text = help_node.value[:1].upper() + help_node.value[1:] + "."
            attr.docstring = Docstring(text, parent=attr)
        attr.value = ast.unparse(call.args[0])
