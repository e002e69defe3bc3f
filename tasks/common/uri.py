"""What an S3 URI is: the one test of the scheme and the one split into bucket and key; and an
address as it may be shown or stored, without the parts where secrets travel."""
from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from tasks.common.secrets import address_secrets, hidden

SCHEME = "s3://"


def is_s3(uri: str) -> bool:
    """Whether ``uri`` names S3 (``s3://bucket/key``) rather than a path on this filesystem."""
    return uri.startswith(SCHEME)


def bucket_and_key(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` as ("bucket", "some/key"); either may be empty."""
    bucket, _, key = uri[len(SCHEME):].partition("/")
    return bucket, key


def shown_address(url: str) -> str:
    """``url`` without its user, password, query string and fragment, and with a path segment that
    reads as a token hidden (where secrets travel): what a log line, an artifact or a file in the run
    folder may hold."""
    parts = urlsplit(url)
    path = hidden(parts.path, [s for s in address_secrets(url) if f"/{s}" in parts.path])
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], path, "", ""))


def hide_address_secrets(text: str, url: str) -> str:
    """``text`` (an error message, say) with every secret part of ``url`` replaced by ``***``."""
    return hidden(text, sorted(address_secrets(url), key=len, reverse=True))
