"""What a rank that tests.fixtures_gpt.GPTLauncher starts runs: ``python -c CODE --config PATH`` as
a child of a fork server that has imported torch once (its import is most of a short run's CPU).

Only the standard library is imported here: the rank's environment is in place before any gpt
module reads it (gpt.faults reads GPT_FAULT when imported)."""
from __future__ import annotations

import atexit
import os
import sys

# Imported once by the fork server, before any rank: what every rank of gpt.train imports anyway.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "numpy"]


def run(code: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """Run ``code`` as ``python -c`` would, with ``env`` as the environment, stdout and stderr to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)    # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)    # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["-c", *argv]
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})   # noqa: S102 - the test's own code
    finally:
        atexit._run_exitfuncs()      # as the interpreter does at exit; the fork server's child skips them
