"""The getting-started guide is a script: scripts/getting-started follows it to the letter (in
CI: .ci/run). These check, with no network, that the page still reads as one, and that the
comparison it makes can fail."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def script() -> ModuleType:
    path = ROOT / "scripts" / "getting_started.py"
    spec = importlib.util.spec_from_file_location("getting_started", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["getting_started"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def test_the_guide_goes_from_nothing_to_every_answer():
    guide = script()
    steps = guide.steps(guide.GUIDE.read_text())
    commands = [step for step in steps if isinstance(step, guide.Command)]
    typed = [step.text for step in commands]
    # An install that works without a published package, with a server and a database.
    assert typed[0] == f"git clone {guide.repository_url()}.git"
    [install] = [text for text in typed if text.startswith("pip install")]
    assert "idempotency-asgi[" in install
    for extra in ("fastapi", "uvicorn", "dev-postgres"):
        assert extra in install
    assert "idempotency-asgi dev-postgres" in typed
    assert "idempotency-asgi migrate" in typed
    servers = [step.text for step in commands if step.serves]
    assert servers == [
        "idempotency-asgi dev-postgres",
        "uvicorn quickstart:app --lifespan on",
        "uvicorn payments:app --lifespan on",
    ]
    # Each file the commands run is saved from the page first.
    saved = [step.name for step in steps if isinstance(step, guide.SaveFile)]
    assert saved == ["quickstart.py", "payments.py"]
    # A new key, its replay, a 409, a 422 and a 401, as a client sees them.
    statuses = [
        int(line.split()[1])
        for step in commands
        for line in step.shown
        if line.startswith("HTTP/1.1 ")
    ]
    assert statuses == [201, 201, 409, 201, 422, 401, 201, 201]
    replays = [step for step in commands if "idempotent-replayed: true" in step.shown]
    assert len(replays) == 3


def test_each_shown_answer_is_compared_line_by_line():
    guide = script()
    ids = guide.Ids()
    shown = ["HTTP/1.1 201 Created", "retry-after: …", "", '{"id":"ord_5d1e8c0f2a9b"}']
    printed = [
        "HTTP/1.1 201 Created",
        "date: Thu, 26 Nov 2026 07:25:17 GMT",  # left out of the page: allowed
        "retry-after: 2",
        "",
        '{"id":"ord_0123456789ab"}',
    ]
    assert guide.matches(shown, printed, ids) == 3
    # The shown id now stands for that real one: a replay with another id does not match.
    assert guide.matches(shown, [*printed[:4], '{"id":"ord_ffffffffffff"}'], ids) == 2
    assert guide.matches(shown, [*printed[:4], '{"id":"ord_0123456789ab"}'], ids) == 3
    # Another status, or a line missing, is a difference.
    assert guide.matches(shown, ["HTTP/1.1 409 Conflict", *printed[1:]], guide.Ids()) == 0
    assert guide.matches(shown, [printed[0], printed[4]], guide.Ids()) == 1


def test_a_block_that_is_not_a_terminal_session_is_refused():
    guide = script()
    with pytest.raises(ValueError, match="without a terminal"):
        guide.steps("```console\n$ ls\n```\n")


def test_output_before_any_command_is_what_the_server_there_printed(tmp_path):
    guide = script()
    [watch] = guide.steps('```console title="Terminal 1"\nhello\n```\n')
    assert watch == guide.Watch("Terminal 1", ["hello"])
    # With no server running in that terminal, there is nothing to have printed it.
    page = tmp_path / "guide.md"
    page.write_text(
        '```console title="Terminal 1"\n$ true\n```\n```console title="Terminal 1"\nhello\n```\n'
    )
    with pytest.raises(guide.Failed, match="no server runs there"):
        guide.follow(page, tmp_path, "https://example.invalid/repository")


def test_the_code_it_saves_is_the_tested_snippets():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    for name in ("quickstart.py", "transactional.py"):
        assert re.search(rf"<!-- code: docs/snippets/{name} -->\n```python title=", text), name
