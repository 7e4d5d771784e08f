"""Which shard a statement would run on under the plan of docs/scaling-out.md, read with
PostgreSQL's own parser (pglast, libpg_query). Nothing here runs SQL.

The plan distributes each table of `DISTRIBUTED` by the column named there. A statement is
single-shard when every reference to such a table pins that column to one query parameter
(`tenant_id = $1` as a top-level conjunct of the WHERE that reads the table, or the value an
INSERT writes into it), and all of them pin the same parameter in the same co-location
group. Anything else (no filter, a filter under OR or NOT, a join on the column, two different
parameters) may touch every shard.

The statements checked are every public string of `idempotency_asgi._postgres.sql` (as its modules
build them, f-strings included), and every other string literal in the package that reads
as a DML statement (`consumer.py`'s, and whatever appears later).
"""

from __future__ import annotations

import ast as python_ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pglast import ast, parse_sql
from pglast.enums import A_Expr_Kind, BoolExprType, SetOperation
from pglast.parser import ParseError

import idempotency_asgi
from idempotency_asgi._postgres import sql

#: The distribution column of each distributed table, and its co-location group (tables of
#: one group have their rows for one value on the same shard).
DISTRIBUTED: dict[str, tuple[str, str]] = {
    "idempotency_keys": ("tenant_id", "tenant"),  # with the application's tables
    "idempotency_leases": ("tenant_id", "tenant"),  # renewals and waiters' marks, the same
    "idempotency_processed_messages": ("message_id", "message"),  # no tenant in its key
}

#: Public strings of _sql that are not statements (every other one must parse as SQL: a
#: new public string that is not SQL goes here, with what it is).
NOT_STATEMENTS = {"CHANNEL": "the LISTEN/NOTIFY channel's name"}

_DML = (ast.SelectStmt, ast.InsertStmt, ast.UpdateStmt, ast.DeleteStmt)
_DML_WORDS = {"SELECT", "INSERT", "UPDATE", "DELETE", "WITH"}
PACKAGE = Path(idempotency_asgi.__file__).resolve().parent


@dataclass(frozen=True)
class Reference:
    """One place a statement reads or writes a distributed table."""

    table: str
    place: str  # where in the statement: "WITH inserted: INSERT", "UNION branch 2: SELECT"
    pinned_to: int | None  # the parameter its distribution column equals; None: not pinned


@dataclass(frozen=True)
class Routing:
    references: tuple[Reference, ...]
    problems: tuple[str, ...]  # why it may span shards; empty when it is single-shard

    @property
    def single_shard(self) -> bool:
        return not self.problems


def route(text: str) -> Routing:
    """Parse `text` (one or more statements) and say whether it stays on one shard."""
    references: list[Reference] = []
    for raw in parse_sql(text):
        nodes = list(_walk(raw.stmt, ""))
        ctes = {node.ctename for node, _ in nodes if isinstance(node, ast.CommonTableExpr)}
        for node, place in nodes:
            if isinstance(node, _DML):
                kind = type(node).__name__.removesuffix("Stmt").upper()
                references.extend(_references(node, _join(place, kind), ctes))
    problems = [
        f"{r.table} in {r.place}: no top-level {DISTRIBUTED[r.table][0]} = $n"
        for r in references
        if r.pinned_to is None
    ]
    pins = {(DISTRIBUTED[r.table][1], r.pinned_to) for r in references if r.pinned_to}
    if len(pins) > 1:
        shown = ", ".join(f"{group} ${number}" for group, number in sorted(pins))
        problems.append(f"pinned to more than one shard key: {shown}")
    return Routing(tuple(references), tuple(problems))


def touches_distributed(text: str) -> bool:
    return bool(route(text).references)


# -- finding the statements -------------------------------------------------------------


def package_statements() -> dict[str, str]:
    """Every statement the package can run, by name: `sql.CLAIM`, `consumer._RECORD`,
    `migrate:28` (a literal not bound to a module-level name: module and line)."""
    found: dict[str, str] = {}
    for name, value in vars(sql).items():
        if isinstance(value, str) and not name.startswith("_") and name not in NOT_STATEMENTS:
            found[f"sql.{name}"] = value
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if module == "idempotency_asgi._postgres.sql" or module.startswith(
            "idempotency_asgi._postgres.sql."
        ):
            continue  # named above, as the package exports them
        found.update(_literals(path, module))
    return found


def unparsable_sql_strings() -> dict[str, str]:
    """Public strings of _postgres/sql/ that PostgreSQL would refuse: a typo there is a failure."""
    bad: dict[str, str] = {}
    for name, value in vars(sql).items():
        if isinstance(value, str) and not name.startswith("_") and name not in NOT_STATEMENTS:
            try:
                parse_sql(value)
            except ParseError as exc:
                bad[f"sql.{name}"] = str(exc)
    return bad


def _literals(path: Path, module: str) -> Iterator[tuple[str, str]]:
    tree = python_ast.parse(path.read_text(), str(path))
    bound: dict[int, str] = {}  # id of a literal node -> the module-level name it is bound to
    for statement in tree.body:
        if isinstance(statement, python_ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, python_ast.Name):
                bound[id(statement.value)] = target.id
    # The literal pieces of an f-string are read as part of the whole f-string.
    pieces = {
        id(part)
        for node in python_ast.walk(tree)
        if isinstance(node, python_ast.JoinedStr)
        for part in node.values
    }
    short = module.rsplit(".", 1)[-1].removeprefix("_")  # its file's name
    loaded: Any = None
    for node in python_ast.walk(tree):
        if id(node) in pieces:
            continue
        if isinstance(node, python_ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, python_ast.JoinedStr):
            loaded = loaded or importlib.import_module(module)
            text = _render(node, loaded)
        else:
            continue
        first = text.lstrip().split(None, 1)[:1]
        if not first or first[0] not in _DML_WORDS:  # the package writes SQL in capitals
            continue
        name = f"{short}.{bound[id(node)]}" if id(node) in bound else f"{short}:{node.lineno}"
        yield name, text


def _render(node: python_ast.JoinedStr, module: Any) -> str:
    """An f-string as it reads at run time, where its parts are module-level strings; any
    other part becomes a placeholder identifier."""
    parts: list[str] = []
    for part in node.values:
        if isinstance(part, python_ast.Constant):
            parts.append(str(part.value))
        elif isinstance(part, python_ast.FormattedValue):
            value = part.value
            known = getattr(module, value.id, None) if isinstance(value, python_ast.Name) else None
            parts.append(known if isinstance(known, str) else "placeholder")
    return "".join(parts)


# -- walking the parse tree -------------------------------------------------------------


def _children(node: ast.Node) -> Iterator[tuple[str, ast.Node]]:
    for attribute in node:
        value = getattr(node, attribute)
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, ast.Node):
                yield attribute, item


def _walk(node: ast.Node, place: str) -> Iterator[tuple[ast.Node, str]]:
    """Every node, with a readable place: the CTE, set-operation branch or subquery it is in."""
    yield node, place
    for attribute, child in _children(node):
        if isinstance(node, ast.SelectStmt) and attribute in ("larg", "rarg"):
            number = 1 if attribute == "larg" else 2
            operation = node.op.name.removeprefix("SETOP_")
            yield from _walk(child, _join(place, f"{operation} branch {number}"))
        elif isinstance(node, ast.CommonTableExpr) and attribute == "ctequery":
            yield from _walk(child, _join(place, f"WITH {node.ctename}"))
        elif isinstance(child, _DML):
            yield from _walk(child, _join(place, "subquery"))
        else:
            yield from _walk(child, place)


def _join(place: str, step: str) -> str:
    return f"{place}: {step}" if place else step


def _references(statement: ast.Node, place: str, ctes: set[str]) -> Iterator[Reference]:
    """The distributed tables a statement names itself (not in its subqueries), and what
    pins each one's distribution column."""
    if isinstance(statement, ast.InsertStmt):
        table = statement.relation
        if table.relname in DISTRIBUTED and table.relname not in ctes:
            yield Reference(table.relname, place, _inserted_parameter(statement))
        return
    if isinstance(statement, ast.SelectStmt):
        tables = list(_ranges(statement.fromClause))
    elif isinstance(statement, ast.UpdateStmt):
        tables = [statement.relation, *_ranges(statement.fromClause)]
    else:
        assert isinstance(statement, ast.DeleteStmt)
        tables = [statement.relation, *_ranges(statement.usingClause)]
    alone = len(tables) == 1
    for table in tables:
        if isinstance(table, ast.RangeVar) and table.relname in DISTRIBUTED:
            if table.relname in ctes and table.schemaname is None:
                continue
            column = DISTRIBUTED[table.relname][0]
            names = {table.alias.aliasname if table.alias else table.relname}
            pinned = _pinned(statement.whereClause, column, names, unqualified=alone)
            yield Reference(table.relname, place, pinned)


def _ranges(items: Any) -> Iterator[ast.Node]:
    """The FROM items of one statement level: tables, subqueries, both sides of joins."""
    for item in items or ():
        if isinstance(item, ast.JoinExpr):
            yield from _ranges((item.larg, item.rarg))
        else:
            yield item


def _pinned(where: Any, column: str, names: set[str], *, unqualified: bool) -> int | None:
    for conjunct in _conjuncts(where):
        if not (
            isinstance(conjunct, ast.A_Expr)
            and conjunct.kind == A_Expr_Kind.AEXPR_OP
            and [n.sval for n in conjunct.name] == ["="]
        ):
            continue
        for side, other in ((conjunct.lexpr, conjunct.rexpr), (conjunct.rexpr, conjunct.lexpr)):
            number = _parameter(other)
            if number is not None and _is_column(side, column, names, unqualified=unqualified):
                return number
    return None


def _conjuncts(where: Any) -> Iterator[Any]:
    """The top-level AND terms of a WHERE: a filter under OR or NOT does not pin anything."""
    if isinstance(where, ast.BoolExpr) and where.boolop == BoolExprType.AND_EXPR:
        for term in where.args:
            yield from _conjuncts(term)
    elif where is not None:
        yield where


def _is_column(node: Any, column: str, names: set[str], *, unqualified: bool) -> bool:
    if not isinstance(node, ast.ColumnRef):
        return False
    fields = [getattr(f, "sval", None) for f in node.fields]
    if fields == [column]:
        return unqualified
    return len(fields) == 2 and fields[0] in names and fields[1] == column


def _parameter(node: Any) -> int | None:
    while isinstance(node, ast.TypeCast):
        node = node.arg
    return node.number if isinstance(node, ast.ParamRef) else None


def _inserted_parameter(statement: ast.InsertStmt) -> int | None:
    """The parameter an INSERT writes into the distribution column, if every row it writes
    takes the same one: `VALUES ($1, ...)` or `SELECT $1, ...`, or `SELECT tenant_id, ...
    FROM t WHERE tenant_id = $1 ...` from one table `t` of the same co-location group (what
    Citus pushes down to the one shard, where it would run `SELECT $1, ...` through the
    coordinator: tests/test_citus_plans.py checks it on the engine)."""
    column, group = DISTRIBUTED[statement.relation.relname]
    names = [target.name for target in statement.cols or ()]
    if column not in names:
        return None
    index = names.index(column)
    source = statement.selectStmt
    if not isinstance(source, ast.SelectStmt) or source.op != SetOperation.SETOP_NONE:
        return None
    if source.valuesLists:
        numbers = {_parameter(row[index]) for row in source.valuesLists}
    else:
        value = source.targetList[index].val
        numbers = {_parameter(value)}
        tables = list(_ranges(source.fromClause))
        if numbers == {None} and len(tables) == 1 and isinstance(tables[0], ast.RangeVar):
            read = tables[0]
            if DISTRIBUTED.get(read.relname, (None, None))[1] == group:
                source_column = DISTRIBUTED[read.relname][0]
                names = {read.alias.aliasname if read.alias else read.relname}
                if _is_column(value, source_column, names, unqualified=True):
                    pinned = _pinned(source.whereClause, source_column, names, unqualified=True)
                    numbers = {pinned}
    return numbers.pop() if len(numbers) == 1 else None


def has_limit(text: str) -> bool:
    """Whether some SELECT in the statement takes a bounded batch (LIMIT)."""
    return any(
        isinstance(node, ast.SelectStmt) and node.limitCount is not None
        for raw in parse_sql(text)
        for node, _ in _walk(raw.stmt, "")
    )
