"""`idempotency-asgi gateway`: the gateway under uvicorn, configured by flags or environment."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from .options import OPTIONS
from .settings import Settings

#: The protocol class in server.py for each --http choice.
PROTOCOLS = {
    "auto": "GatewayProtocol",
    "h11": "GatewayH11Protocol",
    "httptools": "GatewayHttpToolsProtocol",
}

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
        if option.switch:
            shown = " (default: on)" if option.parse(option.default) else " (default: off)"
        else:
            shown = f" (default: {option.default})" if option.default else ""
        help_text = f"{option.help}{shown} [{option.env}]"
        # The top-level --database-url shares the name: keep them apart, reconcile in run().
        dest = "gateway_" + option.field
        # A flag not given is left out (SUPPRESS): run() reads its variable then, so that a
        # bad value is named by the variable it came from.
        if option.switch:
            parser.add_argument(
                option.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=dest,
                type=_said(option.parse),
                default=argparse.SUPPRESS,
                metavar=option.field.upper(),
                help=help_text,
            )


def _said(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """The option's parser, its ValueError's reason told (argparse would only say "invalid
    positive value: 'inf'")."""

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.gateway_parser
    values: dict[str, Any] = {}
    for option in OPTIONS:
        dest = "gateway_" + option.field
        if hasattr(args, dest):
            values[option.field] = getattr(args, dest)
            continue
        try:
            values[option.field] = option.parse(os.environ.get(option.env, option.default))
        except ValueError as exc:
            parser.error(f"{option.env}: {exc}")
    if not values["database_url"]:
        values["database_url"] = args.database_url or ""
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
        # uvloop (the gateway extra installs it); httptools when installed (or asked for),
        # h11 otherwise. The protocol is uvicorn's, with a deadline and a size cap on each
        # request's head (server.py); h11's own cap is set to the same size.
        loop="auto",
        http=f"idempotency_asgi.gateway.server:{PROTOCOLS[settings.http]}",
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=settings.idle_timeout,
        # The upstream's Date and Server pass through; uvicorn adding its own would send two.
        date_header=False,
        server_header=False,
        # The gateway appends the peer's address to X-Forwarded-For itself.
        proxy_headers=False,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: idempotency-asgi gateway --help")
