"""scripts/mutate's driver: one PostgreSQL for the whole run, mutmut over the core modules
(configured in pyproject.toml's [tool.mutmut]), then the score and every surviving mutant by
file:line. Run it through scripts/mutate, which installs mutmut first."""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.local_postgres import LocalPostgres  # noqa: E402

CORE = (
    "_asgi.middleware",
    "_asgi.execution",
    "_postgres.store",
    "_postgres.transaction",
    "_asgi.fingerprint",
    "_asgi.canonical",
    "_asgi.keys",
    "_asgi.lease",
    "_postgres.batching",
    "_postgres.outages",
    "_postgres.claiming",
    "_postgres.recording",
    "_postgres.atomic",
)

#: Enough for several test processes at once, each with its pools.
SERVER_SETTINGS = {"max_connections": "400", "fsync": "off", "synchronous_commit": "off"}

#: mutmut's exit codes, as its `stats` module reads them.
KILLED = {1, 3}
SURVIVED = {0}
NO_TESTS = {5, 33}
TIMEOUT = {-24, 24, 152, 255, 36}


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/mutate", description=__doc__)
    parser.add_argument(
        "modules",
        nargs="*",
        metavar="MODULE",
        help="core modules to mutate, as idempotency_asgi/_postgres/NAME.py or NAME (default: all)",
    )
    parser.add_argument(
        "--children",
        type=int,
        default=4,
        help="mutants tested at once (default 4: the tests mostly wait on the database)",
    )
    parser.add_argument(
        "--survivors",
        action="store_true",
        help="test again only the last run's survivors (and mutants no test ran) against "
        "today's tests, and keep its other verdicts: the score after tests were added, for a "
        "fraction of a full run (the code under test must be unchanged)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="print the score of the last run (in mutants/) without running anything",
    )
    args = parser.parse_args()
    modules = [_module_name(name) for name in args.modules] or list(CORE)
    os.chdir(ROOT)
    if not args.report_only:
        started = time.monotonic()
        status = _run(modules, args.children, survivors_only=args.survivors)
        minutes = (time.monotonic() - started) / 60
        if status != 0:
            print(f"mutmut failed (exit status {status}) after {minutes:.1f} min", file=sys.stderr)
            return status
        print(f"\nrun time {minutes:.1f} min with {args.children} mutants at a time")
    return _report(modules)


def _module_name(argument: str) -> str:
    name = argument.removeprefix("idempotency_asgi/").removesuffix(".py").replace("/", ".")
    # `store` names `_postgres/store.py`
    name = next((core for core in CORE if core.rsplit(".", 1)[-1] == name), name)
    if name not in CORE:
        raise SystemExit(f"scripts/mutate: {argument!r} is not one of the core modules {CORE}")
    return name


def _run(modules: list[str], children: int, *, survivors_only: bool) -> int:
    mutmut = [str(ROOT / ".venv/bin/mutmut"), "run", "--max-children", str(children)]
    # Every module's verdicts are put back afterwards, not only those of the modules retested:
    # mutants/ keeps one run of all eight.
    previous = _previous([name for name in CORE if _meta(name).exists()]) if survivors_only else {}
    if survivors_only:
        missing = [name for name in modules if name not in previous]
        if missing:
            raise SystemExit(f"scripts/mutate: no earlier run of {', '.join(missing)} in mutants/")
        retest = sorted(
            name
            for module in modules
            for name, code in previous[module][0].items()
            if _kind(code) in ("survived", "no tests")
        )
        if not retest:
            print("no survivors to test again")
            return 0
        print(f"testing {len(retest)} survivors of the last run again", flush=True)
        mutmut += retest
    elif len(modules) < len(CORE):
        mutmut += [f"idempotency_asgi.{name}.*" for name in modules]
    # mutmut keeps results between runs and trusts them while a function is unchanged, and
    # while the test selection is: a score must come from today's tests, so every run starts
    # afresh (a run of survivors puts the other verdicts back afterwards).
    shutil.rmtree(ROOT / "mutants", ignore_errors=True)
    configured = os.environ.get("DATABASE_URL")
    if configured:
        status = subprocess.call(mutmut)
    else:
        server = LocalPostgres.temporary()
        try:
            url = _start(server)
            print(f"PostgreSQL for the whole run: {url}", flush=True)
            status = subprocess.call(mutmut, env={**os.environ, "DATABASE_URL": url})
        finally:
            server.stop()
    if status == 0 and previous:
        _restore(previous)
    return status


def _meta(name: str) -> Path:
    return ROOT / "mutants" / f"idempotency_asgi/{name.replace('.', '/')}.py.meta"


def _previous(modules: list[str]) -> dict[str, tuple[dict[str, int | None], dict[str, str]]]:
    """The last run's verdicts and function hashes, per module."""
    previous = {}
    for name in modules:
        meta = json.loads(_meta(name).read_text())
        previous[name] = (meta["exit_code_by_key"], meta["hash_by_function_name"])
    return previous


def _restore(previous: dict[str, tuple[dict[str, int | None], dict[str, str]]]) -> None:
    """Put the earlier verdicts of the mutants not tested again back: a mutant the tests
    killed stays killed when the tests only grew and the code is the same."""
    for name, (codes, hashes) in previous.items():
        meta = json.loads(_meta(name).read_text())
        if meta["hash_by_function_name"] != hashes:
            raise SystemExit(
                f"scripts/mutate: idempotency_asgi/{name}.py changed since the last run; "
                "its survivors cannot be compared: run it in full"
            )
        for mutant, code in codes.items():
            if meta["exit_code_by_key"].get(mutant) is None:
                meta["exit_code_by_key"][mutant] = code
        _meta(name).write_text(json.dumps(meta, indent=4))


def _start(server: LocalPostgres) -> str:
    import asyncio

    import asyncpg

    async def configure(url: str) -> None:
        conn = await asyncpg.connect(url)
        try:
            for name, value in SERVER_SETTINGS.items():
                await conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        finally:
            await conn.close()

    asyncio.run(configure(server.start()))
    return server.restart()  # max_connections needs a restart


# -- the score -------------------------------------------------------------------------------


def _report(modules: list[str]) -> int:
    rows = []
    survivors: list[tuple[str, int, str, str, str]] = []
    for name in modules:
        path = f"idempotency_asgi/{name}.py"
        meta = ROOT / "mutants" / f"{path}.meta"
        if not meta.exists():
            print(f"{path}: no results (run scripts/mutate {path} first)")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        counts = {"killed": 0, "timeout": 0, "survived": 0, "no tests": 0, "other": 0}
        for mutant, code in codes.items():
            kind = _kind(code)
            counts[kind] += 1
            if kind in ("survived", "no tests"):
                line, old, new = _locate(path, mutant)
                survivors.append((path, line, old, new, kind))
        rows.append((path, counts, len(codes)))
    if not rows:
        return 1
    print(f"\n{'module':34} {'killed':>7} {'total':>6} {'score':>6}  survived  no tests  other")
    killed_all = total_all = 0
    for path, counts, total in rows:
        killed = counts["killed"] + counts["timeout"]
        killed_all += killed
        total_all += total
        print(
            f"{path:34} {killed:>7} {total:>6} {_percent(killed, total):>6}  "
            f"{counts['survived']:>8}  {counts['no tests']:>8}  {counts['other']:>5}"
        )
    print(f"{'total':34} {killed_all:>7} {total_all:>6} {_percent(killed_all, total_all):>6}")
    print("\n(killed counts mutants that made a test fail or hang; 'no tests': no test ran it)")
    if survivors:
        print(f"\nsurviving mutants ({len(survivors)}):")
        for path, line, old, new, kind in sorted(survivors):
            note = "  [no tests]" if kind == "no tests" else ""
            print(f"{path}:{line}{note}\n    - {old}\n    + {new}")
    return 0


def _kind(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "other"  # not run (an interrupted run), a crash, or suspicious


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _locate(path: str, mutant: str) -> tuple[int, str, str]:
    """The file line of the mutation, and that line before and after it."""
    import libcst as cst
    from mutmut.mutation import diff_apply

    functions = diff_apply.read_functions_from_index(mutant, path)
    if functions is None:
        module = diff_apply.read_mutants_module(path)
        functions = (
            diff_apply.read_original_function(module, mutant),
            diff_apply.read_mutant_function(module, mutant),
        )
    original, mutated = (cst.Module([f]).code.strip().splitlines() for f in functions)
    # Comments just above a function come with it: count from its `def` (or decorator).
    start = next(
        (i for i, text in enumerate(original) if text.lstrip().startswith(("def ", "async ", "@"))),
        0,
    )
    for tag, i, _, j, _ in difflib.SequenceMatcher(a=original, b=mutated).get_opcodes():
        if tag != "equal":
            old = original[i].strip() if i < len(original) else ""
            new = mutated[j].strip() if j < len(mutated) else ""
            return _function_line(path, mutant) + i - start, old, new
    return _function_line(path, mutant), "", ""


def _function_line(path: str, mutant: str) -> int:
    """The line of the function's `def` (or first decorator) in the source file."""
    name = mutant.rpartition(".")[2].rpartition("__mutmut_")[0]
    if name.startswith("x\u01c1"):
        owner, function = name[2:].split("\u01c1", 1)
    else:
        owner, function = None, name[2:]
    tree = ast.parse((ROOT / path).read_text())
    scopes = [tree]
    if owner is not None:
        scopes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    for scope in scopes:
        for node in scope.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function:
                return min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
