"""Follow docs/getting-started.md to the letter, in an empty folder: scripts/getting-started.

The guide's own blocks are the script, read from the Markdown as a reader reads them:

- a `console` block titled "Terminal N" is typed into terminal N (a bash of its own, started
  in the folder, with no virtualenv active): each `$ ` line is a command (a line ending in `\\`
  goes on), `^C` presses Ctrl+C in it, and the other lines are what the command prints; lines
  before any command are what the server running in that terminal has printed since it
  started (its log lines, once the requests of another terminal have reached it);
- a `python` block titled "NAME.py" is saved as NAME.py in the folder, as a reader does when the
  page says "Save this as ...".

A command passes when it exits with 0 and its output holds the lines shown, in order (lines it
prints that the page leaves out, such as the `date` header, are allowed). In a shown line, `…`
stands for anything, and an id such as `ord_5d1e8c0f2a9b` for any id of that kind: the same
shown id must be the same real one wherever it appears again (a replay is the first answer). A
command whose shown output mentions Ctrl+C is a server: it passes when those lines have
appeared, and it keeps running until a `^C`, or the end.

The one step not taken literally is `git clone` of the project's repository (pyproject.toml's
[project.urls] Repository; the guide must name exactly that): the clone is a copy of this
checkout, as it is on disk, so that the guide is checked against the code beside it.

Exit status 1 on the first step that fails, after printing what was expected and what came.
`--keep DIR` works in DIR (which must be empty or absent) and leaves it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "getting-started.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
TITLE = re.compile(r'title="([^"]+)"')
#: Ids the applications make: shown ones stand for whatever real one comes.
ID = re.compile(r"\b(?:ord|pay)_[0-9a-f]{8,}\b")
COMMAND_TIMEOUT = 300.0  # pip install, the slowest, takes about 30 s
#: The least time a reader takes to type the command after one sent to the background.
TYPING_SECONDS = 0.5


@dataclass
class Command:
    terminal: str
    text: str  # as typed, continuation lines joined with their backslashes
    shown: list[str] = field(default_factory=list)

    @property
    def serves(self) -> bool:
        return any("ctrl+c" in line.lower() for line in self.shown)


@dataclass
class Interrupt:
    terminal: str


@dataclass
class Watch:
    """Lines the server running in a terminal has printed (since it started), in order."""

    terminal: str
    shown: list[str] = field(default_factory=list)


@dataclass
class SaveFile:
    name: str
    text: str


Step = Command | Interrupt | SaveFile | Watch


def steps(markdown: str) -> list[Step]:
    """The guide's blocks, in order, as steps."""
    found: list[Step] = []
    for language, info, body in FENCE.findall(markdown):
        title = TITLE.search(info)
        if language == "python" and title:
            found.append(SaveFile(title.group(1), body))
        elif language == "console":
            if not title or not title.group(1).startswith("Terminal "):
                raise ValueError(f"a console block without a terminal: {body[:60]!r}")
            found.extend(console(title.group(1), body))
    return found


def console(terminal: str, body: str) -> list[Step]:
    found: list[Step] = []
    going_on = False
    for line in body.splitlines():
        if going_on:
            assert isinstance(found[-1], Command)
            found[-1].text += "\n" + line
            going_on = line.endswith("\\")
        elif line.startswith("$ "):
            found.append(Command(terminal, line[2:]))
            going_on = line.endswith("\\")
        elif line.strip() == "^C":
            found.append(Interrupt(terminal))
        elif found and isinstance(found[-1], (Command, Watch)):
            found[-1].shown.append(line)
        elif line.strip():
            found.append(Watch(terminal, [line]))  # what the server there has printed
    return found


class Ids:
    """Shown ids, and the real ones they stood for."""

    def __init__(self) -> None:
        self.real: dict[str, str] = {}

    def pattern(self, shown: str) -> re.Pattern[str]:
        parts = []
        position = 0
        for made in re.finditer(r"…|" + ID.pattern, shown):
            parts.append(re.escape(shown[position : made.start()]))
            token = made.group()
            if token == "…":
                parts.append(".*")
            elif token in self.real:
                parts.append(re.escape(self.real[token]))
            else:
                parts.append(f"(?P<id{len(parts)}>{token[:4]}[0-9a-f]+)")
            position = made.end()
        parts.append(re.escape(shown[position:]))
        return re.compile("".join(parts) + r"\s*$")

    def learn(self, shown: str, match: re.Match[str]) -> None:
        tokens = [t.group() for t in re.finditer(r"…|" + ID.pattern, shown)]
        fresh = [t for t in tokens if t != "…" and t not in self.real]
        for token, value in zip(fresh, [v for v in match.groupdict().values()], strict=True):
            self.real[token] = value


def matches(shown: list[str], printed: list[str], ids: Ids) -> int:
    """How many of the shown lines were found in order in what was printed (all of them: a
    pass). Blank lines are not compared."""
    wanted = [line.rstrip() for line in shown if line.strip()]
    at = 0
    for count, line in enumerate(wanted):
        pattern = ids.pattern(line)
        while at < len(printed):
            found = pattern.match(printed[at].rstrip())
            at += 1
            if found:
                ids.learn(line, found)
                break
        else:
            return count
    return len(wanted)


class Terminal:
    """A bash in the folder, typed into through its standard input."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if ".venv" not in p]
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("VIRTUAL_ENV", "DATABASE_URL", "PYTHONPATH", "PYTHONHOME")
        }
        env.update(PATH=os.pathsep.join(path), PIP_DISABLE_PIP_VERSION_CHECK="1", TERM="dumb")
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=folder,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.commands = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n").replace("\r", ""))
                self.changed.notify_all()

    def type(self, command: str) -> tuple[int, str]:
        """Send a command; returns where its output starts and the marker of its end."""
        self.commands += 1
        marker = f"__guide_{self.commands}__"
        start = len(self.lines)
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command}\n__status=$?; echo; echo {marker} $__status\n")
        self.process.stdin.flush()
        return start, marker

    def wait(self, until: float, done: Callable[[], bool]) -> bool:
        with self.changed:
            while not done():
                left = until - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    return bool(done())
                self.changed.wait(min(left, 1.0))
            return True

    def ended(self, start: int, marker: str) -> int | None:
        """The exit status of the command whose output starts at start, once it ended."""
        for line in self.lines[start:]:
            if line.startswith(marker + " "):
                return int(line.split()[1])
        return None

    def output(self, start: int, marker: str) -> list[str]:
        lines = self.lines[start:]
        for i, line in enumerate(lines):
            if line.startswith(marker + " "):
                return lines[: i - 1]  # the `echo` before the marker
        return lines

    def interrupt(self) -> None:
        """Ctrl+C: SIGINT to what runs in the foreground (the shell's own children)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        for pid in children.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGINT)

    def close(self) -> None:
        if self.process.poll() is None:
            self.interrupt()
            assert self.process.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.write("exit\n")
                self.process.stdin.flush()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Its pipes too, once everything it wrote is read.
        self.reader.join(timeout=5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


class Failed(Exception):
    pass


def follow(guide: Path, folder: Path, repository: str) -> None:
    terminals: dict[str, Terminal] = {}
    running: dict[str, tuple[Command, int, str]] = {}  # a server in each terminal
    ids = Ids()
    try:
        for step in steps(guide.read_text()):
            if isinstance(step, SaveFile):
                say(f"save {step.name}")
                (folder / step.name).write_text(step.text)
                continue
            terminal = terminals.get(step.terminal)
            if terminal is None:
                terminal = terminals[step.terminal] = Terminal(step.terminal, folder)
            if isinstance(step, Watch):
                say(f"{step.terminal}: (what its server printed)")
                if step.terminal not in running:
                    raise Failed(f"{step.terminal}: output shown, but no server runs there")
                served, start, marker = running[step.terminal]
                watched = Command(step.terminal, served.text, step.shown)
                # Logged as each answer is sent: a moment after the client has it, at most.
                terminal.wait(time.monotonic() + 10, has_served(terminal, watched, start, marker))
                check(watched, terminal.output(start, marker), ids)
                continue
            if isinstance(step, Interrupt):
                say(f"{step.terminal}: ^C")
                if step.terminal not in running:
                    raise Failed(f"{step.terminal}: ^C, but nothing runs there")
                _, start, marker = running.pop(step.terminal)
                terminal.interrupt()
                if not terminal.wait(time.monotonic() + 30, has_ended(terminal, start, marker)):
                    raise Failed(f"{step.terminal}: still running 30 s after Ctrl+C")
                continue
            if step.terminal in running:
                raise Failed(f"{step.terminal}: {step.text!r} typed while a server runs there")
            say(f"{step.terminal}: $ {step.text}")
            started = time.monotonic()
            clone = re.fullmatch(r"git clone (\S+)", step.text)
            if clone:
                if clone.group(1) != repository + ".git":
                    raise Failed(f"the guide clones {clone.group(1)}, not {repository}.git")
                copy_checkout(folder / Path(clone.group(1)).stem)
                continue
            start, marker = terminal.type(step.text)
            if step.text.rstrip().endswith("&"):
                # Sent to the background: a reader types the next command after it, which
                # takes a moment; typed at once, the next request could reach the server
                # first (and the guide's 409 would go to the other one).
                time.sleep(TYPING_SECONDS)
            until = time.monotonic() + COMMAND_TIMEOUT
            if step.serves:
                terminal.wait(until, has_served(terminal, step, start, marker))
                status = terminal.ended(start, marker)
                printed = terminal.output(start, marker)
                if status is not None:
                    raise Failed(report(step, printed, f"it exited ({status}) instead of serving"))
                check(step, printed, ids)
                running[step.terminal] = (step, start, marker)
            else:
                terminal.wait(until, has_ended(terminal, start, marker))
                status = terminal.ended(start, marker)
                printed = terminal.output(start, marker)
                if status is None:
                    raise Failed(report(step, printed, f"still running after {COMMAND_TIMEOUT} s"))
                if status != 0:
                    raise Failed(report(step, printed, f"exit status {status}"))
                check(step, printed, ids)
            say(f"    ok ({time.monotonic() - started:.1f} s)")
    finally:
        for terminal in terminals.values():
            terminal.close()


def has_ended(terminal: Terminal, start: int, marker: str) -> Callable[[], bool]:
    return lambda: terminal.ended(start, marker) is not None


def has_served(terminal: Terminal, step: Command, start: int, marker: str) -> Callable[[], bool]:
    """The server printed what the guide shows (or it ended)."""
    wanted = len([line for line in step.shown if line.strip()])

    def served() -> bool:
        printed = terminal.output(start, marker)
        return (
            matches(step.shown, printed, Ids()) == wanted
            or terminal.ended(start, marker) is not None
        )

    return served


def check(step: Command, printed: list[str], ids: Ids) -> None:
    wanted = [line for line in step.shown if line.strip()]
    found = matches(step.shown, printed, ids)
    if found != len(wanted):
        raise Failed(report(step, printed, f"no line like {wanted[found]!r}"))


def report(step: Command, printed: list[str], why: str) -> str:
    shown = "\n".join("    " + line for line in step.shown) or "    (nothing)"
    came = "\n".join("    " + line for line in printed[-60:]) or "    (nothing)"
    return (
        f"{step.terminal}: $ {step.text}\n  failed: {why}\n  the guide shows:\n{shown}\n"
        f"  it printed:\n{came}"
    )


def copy_checkout(target: Path) -> None:
    """This checkout's files, committed or not (not what git ignores), as a clone would have."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / name.decode()
        if source.is_file():
            (target / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name.decode())
    say(f"    (a copy of {ROOT}, as it is on disk, stands for the clone)")


def repository_url() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'^Repository = "([^"]+)"', text, re.MULTILINE)
    if not found:
        raise SystemExit("pyproject.toml names no Repository in [project.urls]")
    return found.group(1)


def say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/getting-started", description=__doc__)
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it")
    parser.add_argument("--guide", type=Path, default=GUIDE, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.keep:
        folder = args.keep.resolve()
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.iterdir()):
            raise SystemExit(f"{folder} is not empty")
    else:
        folder = Path(tempfile.mkdtemp(prefix="getting-started-"))
    started = time.monotonic()
    say(f"Following {args.guide.relative_to(ROOT)} in {folder}")
    try:
        follow(args.guide, folder, repository_url())
    except Failed as failure:
        say(f"\n{failure}\n\ngetting started: FAILED after {time.monotonic() - started:.0f} s")
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    say(f"getting started: every step as the guide shows, in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
