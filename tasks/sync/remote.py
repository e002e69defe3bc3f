"""S3 access: where and how to reach it (credentials from the standard chain, never from here), and its errors as one clear line."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

import boto3
import botocore.exceptions as bexc
import botocore.loaders
import botocore.session
import botocore.utils
from botocore import UNSIGNED
from botocore.config import Config as BotoConfig

from tasks.common.uri import bucket_and_key, is_s3

_LOADER = botocore.loaders.create_loader()


def parse_timestamp(text: str) -> datetime:
    """A timestamp of a response. botocore's own parser (dateutil) takes most of a listing's time,
    one per object, for the ISO 8601 form that `datetime` reads directly; other forms go to it."""
    try:
        parsed = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        parsed = None
    return parsed if parsed is not None and parsed.tzinfo is not None else botocore.utils.parse_timestamp(text)


class SyncError(RuntimeError):
    """A one-line error: what failed and what to do about it. Running again does not help."""
    transient = False


class TransientSyncError(SyncError):
    """Network trouble, an interrupted transfer or a changed object: running again continues."""
    transient = True


@dataclass(frozen=True)
class Remote:
    """Where and how to reach S3. Credentials come from the standard chain, never from here."""
    endpoint_url: str | None = None
    no_sign_request: bool = False
    profile: str | None = None

    @staticmethod
    def make(endpoint_url: str | None, no_sign_request: bool, profile: str | None) -> "Remote":
        env = os.environ
        endpoint = (endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                    or env.get("S3_ENDPOINT_URL") or None)
        return Remote(endpoint, no_sign_request, profile)

    def options(self) -> dict[str, Any]:
        """As ``sync`` and ``upload`` take it (the endpoint as given: the environment's is theirs to add)."""
        return {"endpoint_url": self.endpoint_url, "no_sign_request": self.no_sign_request, "profile": self.profile}

    def client(self) -> Any:
        core = botocore.session.Session(profile=self.profile)
        core.register_component("data_loader", _LOADER)   # parse botocore's model files once
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
        try:
            core.get_scoped_config()    # raises when the profile does not exist
        except bexc.ProfileNotFound:
            raise SyncError(f"AWS profile {self.profile!r} is not in the AWS config/credentials files: "
                            "check --profile") from None
        session = boto3.Session(botocore_session=core)
        config = BotoConfig(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5,
                            read_timeout=60, max_pool_connections=32,
                            signature_version=UNSIGNED if self.no_sign_request else None)
        client = session.client("s3", endpoint_url=self.endpoint_url, config=config,
                                region_name=session.region_name or "us-east-1")
        client.meta.events.register_first("needs-retry.s3", self._refuse_redirects_without_region)
        return client

    def _refuse_redirects_without_region(self, response: Any = None, **_: Any) -> None:
        """A redirect that names no bucket region sends botocore asking the endpoint for the region
        again and again (an endpoint that redirects to itself: hundreds of requests, then a
        RecursionError). Such an answer ends the call at once, as one line."""
        if response is None:
            return
        http = response[0]
        if 300 <= http.status_code < 400 and http.status_code != 304 and "x-amz-bucket-region" not in http.headers:
            location = str(http.headers.get("location", "")).split("?")[0].split("#")[0]
            raise SyncError(f"the S3 endpoint {self.where} answered with a redirect (HTTP {http.status_code}"
                            + (f" to {location}" if location else "") + ") that names no bucket region: "
                            "check --endpoint-url (the store's own address, with http:// or https:// as it serves)")

    def s5cmd_args(self) -> list[str]:
        args = []
        if self.endpoint_url:
            args += ["--endpoint-url", self.endpoint_url]
        if self.no_sign_request:
            args.append("--no-sign-request")
        if self.profile:
            args += ["--profile", self.profile]
        return args

    @property
    def where(self) -> str:
        return self.endpoint_url or "S3"


def _secrets(remote: Remote | None = None) -> list[str]:
    found = [os.environ.get(k) for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")]
    if remote is not None and remote.profile and not remote.no_sign_request:
        try:
            creds = boto3.Session(profile_name=remote.profile).get_credentials()
            if creds is not None:
                found += [creds.secret_key, creds.token, creds.access_key]
        except bexc.BotoCoreError:
            pass
    return [s for s in found if s and len(s) >= 4]


def redact(text: str, remote: Remote | None = None) -> str:
    """`text` with any credential of the environment (or profile) replaced by ***."""
    for secret in _secrets(remote):
        text = text.replace(secret, "***")
    return text


def error_for(code: str, message: str, uri: str, remote: Remote) -> SyncError:
    """Map an S3 error code or s5cmd error text to a one-line error."""
    bucket = bucket_and_key(uri)[0] if is_s3(uri) else uri
    text = f"{code} {message}"
    if "NoSuchBucket" in text:
        return SyncError(f"bucket {bucket!r} does not exist at {remote.where} ({uri}): "
                         "check the bucket name and --endpoint-url")
    if "NoCredentialProviders" in text or "NoCredentials" in text or "Unable to locate credentials" in text:
        return SyncError(_NO_CREDENTIALS.format(uri=uri))
    if any(c in text for c in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken")):
        return SyncError(f"{remote.where} rejected the AWS credentials ({code or 'signature'}) for {uri}: "
                         "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --profile")
    if "AccessDenied" in text or "AllAccessDisabled" in text or code == "403":
        hint = ("the bucket does not allow anonymous access: drop --no-sign-request and use credentials"
                if remote.no_sign_request else
                "check that these credentials (or --profile) may read it, or use --no-sign-request for a public bucket")
        return SyncError(f"access denied to {uri}: {hint}")
    if "NoSuchKey" in text or code == "404":
        return TransientSyncError(f"{uri} disappeared from {remote.where} during the sync: run it again")
    network = ("RequestError", "dial tcp", "connection refused", "Could not connect", "timeout", "Timeout",
               "connection reset", "EOF", "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeTooSkewed")
    if any(n in text for n in network) or code.startswith("5"):
        return TransientSyncError(f"cannot reach the S3 endpoint {remote.where} for {uri} "
                                  f"({redact(message, remote)[:160]}): check --endpoint-url and the network")
    return SyncError(f"S3 error on {uri}: {code} {redact(message, remote)[:200]}".strip())


_NO_CREDENTIALS = ("no AWS credentials found for {uri}: set AWS_PROFILE (or --profile) or "
                   "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use --no-sign-request for a public bucket")


def s3_call(fn: Callable[[], Any], uri: str, remote: Remote) -> Any:
    """`fn()`, with boto3's errors turned into one-line SyncErrors about `uri`."""
    try:
        return fn()
    except bexc.NoCredentialsError:
        raise SyncError(_NO_CREDENTIALS.format(uri=uri)) from None
    except (bexc.EndpointConnectionError, bexc.ConnectTimeoutError, bexc.ReadTimeoutError,
            bexc.ConnectionClosedError) as e:
        raise TransientSyncError(f"cannot reach the S3 endpoint {remote.where} for {uri}: "
                                 f"check --endpoint-url and the network ({type(e).__name__})") from None
    except bexc.ClientError as e:
        err = e.response.get("Error", {})
        code = str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        raise error_for(code, str(err.get("Message", "")), uri, remote) from None


def split_s3(uri: str) -> tuple[str, str]:
    bucket, key = bucket_and_key(uri)
    if not bucket:
        raise SyncError(f"{uri!r} names no bucket: write s3://BUCKET/KEY")
    return bucket, key
