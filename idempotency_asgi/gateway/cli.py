"""`idempotency-asgi gateway`: the gateway under uvicorn, configured by flags or environment."""

from __future__ import annotations

import argparse
import os
import sys

from .options import OPTIONS
from .settings import Settings

DESCRIPTION = """\
Run the idempotency gateway in front of an HTTP service: POST and PATCH requests that carry an
Idempotency-Key run once upstream, and their retries get the recorded answer; everything else
streams through. Every option also reads an environment variable (shown in brackets); a flag
wins over it."""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "gateway",
        help="run the gateway in front of an HTTP service",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(gateway_parser=parser)
    for option in OPTIONS:
        default = os.environ.get(option.env, option.default)
        if option.switch:
            shown = " (default: on)" if option.parse(option.default) else " (default: off)"
        else:
            shown = f" (default: {option.default})" if option.default else ""
        help_text = f"{option.help}{shown} [{option.env}]"
        # The top-level --database-url shares the name: keep them apart, reconcile in run().
        dest = "gateway_" + option.field
        if option.switch:
            # A string default is parsed in run(), so that a bad variable is named there.
            parser.add_argument(
                option.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=dest,
                type=option.parse,
                default=default,
                metavar=option.field.upper(),
                help=help_text,
            )


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.gateway_parser
    values = {option.field: getattr(args, "gateway_" + option.field) for option in OPTIONS}
    if not values["database_url"]:
        values["database_url"] = args.database_url or ""
    for option in OPTIONS:
        if option.switch and isinstance(values[option.field], str):
            try:
                values[option.field] = option.parse(values[option.field])
            except ValueError as exc:
                parser.error(f"{option.env}: {exc}")
    try:
        settings = Settings.from_values(values)
        settings.build()  # opens nothing; refuses what only the gateway can check (the URL)
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.update(settings.environment())
    import uvicorn

    uvicorn.run(
        "idempotency_asgi.gateway.settings:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level=settings.log_level,
        access_log=settings.access_log,
        lifespan="on",
        # uvloop (the gateway extra installs it) and httptools when installed; asyncio and h11
        # otherwise.
        loop="auto",
        http="auto",
        # The upstream's Date and Server pass through; uvicorn adding its own would send two.
        date_header=False,
        server_header=False,
        # The gateway appends the peer's address to X-Forwarded-For itself.
        proxy_headers=False,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: idempotency-asgi gateway --help")
