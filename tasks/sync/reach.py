"""What local files a sync may read: regular files only, inside the allowed roots (links resolved),
never the sync's own destination."""
from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.sync.remote import SyncError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def kind(mode: int) -> str:
    """What a file of this mode is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies in it (both resolved)."""
    return path == folder or folder in path.parents


@dataclass(frozen=True)
class Reach:
    """The local files a sync may read. ``roots`` None: anywhere; ``dest`` None: no local destination."""
    roots: tuple[Path, ...] | None = None
    dest: Path | None = None

    @classmethod
    def make(cls, allowed_roots: Sequence[str | os.PathLike] | None = None,
             dest: str | os.PathLike | None = None) -> Reach:
        roots = None if allowed_roots is None else tuple(Path(r).expanduser().resolve() for r in allowed_roots)
        return cls(roots, None if dest is None else Path(dest).expanduser().resolve())

    def folder(self, path: str) -> None:
        """Refuse walking the folder ``path`` when the destination lies inside it."""
        real = Path(path).resolve()
        if self.dest is not None and inside(self.dest, real):
            raise SyncError(f"the destination {self.dest} lies inside the source folder {path}: the sync would "
                            "read its own copies back; choose a destination outside the sources")

    def file(self, path: str) -> os.stat_result:
        """The stat (links followed) of the source file ``path``, if a sync may read it; else SyncError."""
        real = Path(os.path.realpath(path))
        shown = f"{path} (a link to {real})" if str(real) != os.path.abspath(path) else path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise SyncError(f"{shown} does not exist: check the path") from None
        except OSError as e:
            raise SyncError(f"cannot read {shown}: {e.strerror}: check its permissions") from None
        if self.roots is not None and not any(inside(real, root) for root in self.roots):
            raise SyncError(f"{shown} is outside the folders this sync may read "
                            f"({', '.join(map(str, self.roots))}): copy it there or ask the operator")
        if self.dest is not None and inside(real, self.dest):
            raise SyncError(f"{shown} lies inside the destination {self.dest}: the sync would read its own "
                            "copies back; choose sources outside the destination")
        if not stat.S_ISREG(st.st_mode):
            raise SyncError(f"{shown} is {kind(st.st_mode)}, not a regular file: sources are regular files "
                            "or folders of them; leave it out of the sources")
        return st
