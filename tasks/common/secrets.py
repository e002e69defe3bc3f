"""The secrets a process knows, and the one filter every log record of it passes so that none of them
is written anywhere a log line goes (the terminal, the Prefect run's log, a job's log), whoever wrote
the record: this project, Prefect, urllib3 or boto3.

What counts as a secret: the value of every variable named like one (``credential_variables``:
AWS keys and tokens, ``PREFECT_API_KEY``, anything named SECRET, TOKEN, PASSWORD...), and the parts of
every address in the environment where secrets travel (a tracker's or an endpoint's user and
password, its query values and fragment, and a path segment that reads as a token)."""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from urllib.parse import parse_qsl, urlsplit

SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|API_KEY|AUTH", re.I)
_TOKEN_LIKE = re.compile(r"(?=.*\d)(?=.*[A-Za-z])[A-Za-z0-9_\-.~]{12,}")   # letters and digits, long
_SHORTEST = 4              # shorter strings are too common to be told from ordinary text
_SWITCHES = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null"})


def credential_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Names of the variables in ``environ`` that hold credentials: a job never gets them."""
    return sorted(k for k in environ if SECRET_NAME.search(k))


def address_secrets(url: str) -> list[str]:
    """The parts of ``url`` where secrets travel: user, password, query values, fragment, and path
    segments that read as tokens."""
    try:
        parts = urlsplit(url)
        found = [parts.username, parts.password, parts.fragment, parts.query]
    except ValueError:
        return []
    found += [value for _, value in parse_qsl(parts.query, keep_blank_values=True)]
    found += [segment for segment in parts.path.split("/") if _TOKEN_LIKE.fullmatch(segment)]
    return [s for s in found if s and len(s) >= _SHORTEST]


def known_secrets(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every secret of ``environ``, longest first (a secret that holds another is hidden whole). A
    variable named like a secret whose value is a switch or a number holds none."""
    found = [value for name in credential_variables(environ)
             if (value := environ[name]).lower() not in _SWITCHES and not value.isdigit()]
    found += [secret for value in environ.values() if "://" in value for secret in address_secrets(value)]
    return sorted({s for s in found if s and len(s) >= _SHORTEST}, key=len, reverse=True)


def hidden(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class _Hiding:
    """A log record factory that makes every record's message, and its traceback, without the
    process's secrets (read again at each record: the environment may gain some)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __call__(self, *args: object, **kwargs: object) -> logging.LogRecord:
        record = self.inner(*args, **kwargs)
        secrets = known_secrets()
        if not secrets:
            return record
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is the handler's to say
            return record
        record.msg, record.args = hidden(message, secrets), None
        if record.exc_info:
            record.exc_text = hidden(logging.Formatter().formatException(record.exc_info), secrets)
            record.exc_info = None
        return record


def hide_in_logs() -> None:
    """From now on no log record of this process holds one of its secrets (idempotent)."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _Hiding):
        logging.setLogRecordFactory(_Hiding(factory))
