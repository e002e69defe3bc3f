"""Files that appear whole or not at all: written under a temporary name beside their place and
renamed onto it, so a reader (or a later run after a crash) never sees part of one."""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replaced(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed onto it when the block ends without an error and
    removed otherwise. The name is this writer's own (process and thread), never shared."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    with replaced(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def write_json(path: str | os.PathLike, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
