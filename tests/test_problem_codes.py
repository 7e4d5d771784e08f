"""Every problem body carries a `code` beside its `type`: the word the IETF Idempotency-Key
draft's implementations use for it (anyonce's profile), or the type's own name."""

from __future__ import annotations

import inspect

import orjson

from idempotency_asgi import problems
from idempotency_asgi.gateway import problems as gateway_problems

#: anyonce's vocabulary (docs/problems.md there), for the problems both answer.
PROFILE_WORDS = {
    "missing-key": "missing-key",
    "invalid-key": "invalid-key",
    "request-in-progress": "conflict",
    "key-reused": "fingerprint-mismatch",
    "body-too-large": "payload-too-large",
    "store-unavailable": "store-unavailable",
}

ARGUMENTS = {"reason": "r", "name": "x", "path": "/p", "error": "e", "challenge": "Bearer"}


def every_problem() -> list[problems.Problem]:
    found = []
    for module in (problems, gateway_problems):
        for name, factory in inspect.getmembers(module, inspect.isfunction):
            if factory.__module__ != module.__name__ or name.startswith("_"):
                continue
            parameters = inspect.signature(factory).parameters
            found.append(factory(**{p: ARGUMENTS.get(p, 1) for p in parameters}))
    return found


def test_every_body_carries_its_code_beside_its_type():
    for problem in every_problem():
        _, body = problem.render()
        members = orjson.loads(body)
        assert list(members)[:2] == ["type", "code"], problem.name
        assert members["code"] == PROFILE_WORDS.get(problem.name, problem.name)


def test_the_profiles_words_are_the_codes_of_the_problems_it_names():
    named = {problem.name: problem.code for problem in every_problem()}
    for name, word in PROFILE_WORDS.items():
        assert named[name] == word
