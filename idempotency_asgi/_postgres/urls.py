"""The database URLs applications hold, as asyncpg takes them.

asyncpg takes `postgresql://` and `postgres://` URLs. The settings of a SQLAlchemy application
hold the same database as `postgresql+asyncpg://...` (the driver named in the scheme, and
asyncpg's connect arguments in the query: `?ssl=require`); that URL is the one a team passes to
the store. Given as it is, asyncpg refused it only when the store first connected, and the
refusal was taken for an outage: every keyed request answered 503 with Retry-After, which
clients (the library's own among them) retry for ever.

A URL is read once, when the store (or `migrate`, or the CLI) is given it: one that names
another driver or another database, or is not a URL at all, raises ValueError then, with what
to write instead. What only the server can judge (a password, a database that is not there)
is its answer when the store connects: a refusal, never an outage (see connections.py).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

#: The schemes asyncpg reads, and SQLAlchemy's name for the same database through asyncpg.
ASYNCPG_SCHEMES = frozenset({"postgresql", "postgres"})
SQLALCHEMY_ASYNCPG = frozenset({"postgresql+asyncpg", "postgres+asyncpg"})

#: What SQLAlchemy's `str(url)` writes in place of the password.
HIDDEN_PASSWORD = "***"

#: `?ssl=` in SQLAlchemy's asyncpg URLs is an argument of asyncpg.connect; in a URL asyncpg
#: reads, the same choice is `sslmode` (an unknown parameter would be sent to the server as a
#: setting, and `ssl` is one the server refuses to change).
SSL_MODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})

#: Other arguments of asyncpg.connect (or of SQLAlchemy's dialect) that SQLAlchemy reads from
#: the query: in asyncpg's URL they would become server settings that do not exist.
CONNECT_ARGUMENTS = frozenset(
    {
        "command_timeout",
        "timeout",
        "statement_cache_size",
        "max_cached_statement_lifetime",
        "max_cacheable_statement_size",
        "prepared_statement_cache_size",
        "prepared_statement_name_func",
    }
)

_EXAMPLE = "postgresql://user:password@host:5432/dbname"


def asyncpg_url(url: str) -> str:
    """`url` as asyncpg takes it: `postgresql://` and `postgres://` as they are, SQLAlchemy's
    `postgresql+asyncpg://` as `postgresql://` (its `?ssl=` as `?sslmode=`). ValueError, saying
    what to write instead, for a URL of another driver or database, SQLAlchemy's printed form
    (the password hidden), or a string that is not a URL."""
    url = url.strip()  # a URL read from a file or a secret often ends with a newline
    scheme, separator, rest = url.partition("://")
    if not separator:
        # Not repeated in the message: it may hold a password.
        if "=" in url:
            raise ValueError(
                f"the database URL is a key=value connection string: asyncpg takes a URL, "
                f"{_EXAMPLE}"
            )
        raise ValueError(f"the database URL is not a URL: expected {_EXAMPLE}")
    scheme = scheme.lower()
    if scheme in SQLALCHEMY_ASYNCPG:
        url = "postgresql://" + rest
    elif scheme not in ASYNCPG_SCHEMES:
        raise ValueError(_unusable(scheme))
    parts = urlsplit(url)
    if parts.password == HIDDEN_PASSWORD:
        raise ValueError(
            "the database URL's password is '***': that is how SQLAlchemy prints a URL, "
            "hiding it; pass url.render_as_string(hide_password=False), or the setting the "
            "URL was made from"
        )
    return _asyncpg_query(url, parts.query)


def _unusable(scheme: str) -> str:
    base, _, driver = scheme.partition("+")
    if base in ASYNCPG_SCHEMES:
        return (
            f"the database URL names the driver {driver!r} ({scheme}://): the key store "
            f"connects with asyncpg; write postgresql:// (or postgresql+asyncpg://) with the "
            f"same user, host and database, and the query options asyncpg reads"
        )
    return (
        f"the database URL is for {base!r} ({scheme}://), not PostgreSQL: the key store "
        f"needs a PostgreSQL database, named as {_EXAMPLE}"
    )


def _asyncpg_query(url: str, query: str) -> str:
    """The URL with SQLAlchemy's asyncpg arguments in its query said as asyncpg's URL says
    them, or refused; unchanged when it has none."""
    pairs = parse_qsl(query, keep_blank_values=True)
    names = {name for name, _ in pairs}
    if "ssl" not in names and not names & CONNECT_ARGUMENTS:
        return url
    written = []
    for name, value in pairs:
        if name in CONNECT_ARGUMENTS:
            raise ValueError(
                f"the database URL's query has {name}=, an argument SQLAlchemy passes to "
                f"asyncpg.connect; in a URL asyncpg reads it would be sent to the server as a "
                f"setting: leave it out, and give the store's `timeout` or its "
                f"`pool_options` instead"
            )
        if name == "ssl":
            if value not in SSL_MODES:
                raise ValueError(
                    f"the database URL's query has ssl={value}: write sslmode= with one of "
                    f"{', '.join(sorted(SSL_MODES))}"
                )
            name = "sslmode"
        written.append((name, value))
    return urlunsplit(urlsplit(url)._replace(query=urlencode(written)))
