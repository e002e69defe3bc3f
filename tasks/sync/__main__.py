"""python -m tasks.sync SRC... DST: sync (or upload, for an s3:// DST) from the command line."""
from __future__ import annotations

import argparse
import sys

from tasks.common.run_context import log_to_stderr
from tasks.common.uri import is_s3
from tasks.sync.download import sync
from tasks.sync.remote import SyncError, redact
from tasks.sync.uploader import upload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tasks.sync", usage="%(prog)s SRC... DST [options]", description=__doc__.split("\n\n")[0],
        epilog="A DST of s3://BUCKET/PREFIX uploads one local SRC there instead.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="sources (s3://bucket/key, s3://bucket/prefix/, globs, /path, file:///path), then DST")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS, or $AWS_ENDPOINT_URL)")
    p.add_argument("--no-sign-request", action="store_true", help="anonymous access to a public bucket")
    p.add_argument("--profile", help="AWS profile (default: the standard credential chain)")
    p.add_argument("--workers", type=int, default=256, help="files in flight (s5cmd --numworkers)")
    p.add_argument("--part-size-mb", type=int, default=50, help="multipart part size in MiB")
    p.add_argument("--concurrency", type=int, default=5, help="parts in flight per file")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="upload: leave out the files whose path in SRC matches PATTERN (fnmatch; repeatable)")
    p.add_argument("--delete", action="store_true", help="remove local files that no source has")
    p.add_argument("--verify-content", action="store_true",
                   help="read everything again: hash every local source and its copy, verify every S3 copy")
    args = p.parse_args(argv)
    if len(args.paths) < 2:
        p.error("give at least one SRC and a DST")
    log_to_stderr()
    *sources, dest = args.paths
    opts = dict(endpoint_url=args.endpoint_url, no_sign_request=args.no_sign_request, profile=args.profile,
                workers=args.workers, part_size_mb=args.part_size_mb, concurrency=args.concurrency)
    try:
        if is_s3(dest):
            if len(sources) != 1 or args.delete or args.verify_content:
                p.error("an upload takes exactly one local SRC and no --delete or --verify-content")
            m = upload(sources[0], dest, exclude=args.exclude, **opts)
        else:
            if args.exclude:
                p.error("--exclude is for an upload (an s3:// DST): list the sources to sync instead")
            m = sync(sources, dest, delete=args.delete, verify_content=args.verify_content, **opts)
    except SyncError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"manifest: {m.manifest_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
