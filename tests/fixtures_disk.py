"""`disk`: small real tmpfs mounts for the tests of full and read-only disks (root with the right
to mount; a test skips, saying why, where mounting is not permitted)."""
from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts a tmpfs of the given size (``"2m"``) under tmp_path; unmounted after the test."""
    mounts: list[Path] = []

    def mount(size: str = "2m") -> Path:
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): these tests need root "
                        "with the right to mount (CAP_SYS_ADMIN)")
        mounts.append(folder)
        return folder

    yield mount
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def read_only(folder: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount {folder} read-only ({done.stderr.strip()})")
