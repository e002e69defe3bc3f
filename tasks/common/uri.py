"""What an S3 URI is: the one test of the scheme and the one split into bucket and key."""
from __future__ import annotations

SCHEME = "s3://"


def is_s3(uri: str) -> bool:
    """Whether ``uri`` names S3 (``s3://bucket/key``) rather than a path on this filesystem."""
    return uri.startswith(SCHEME)


def bucket_and_key(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` as ("bucket", "some/key"); either may be empty."""
    bucket, _, key = uri[len(SCHEME):].partition("/")
    return bucket, key
