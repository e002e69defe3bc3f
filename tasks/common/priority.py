"""The CPU priority of work that must not slow down what it serves (copies beside training,
hashing beside the transfer it verifies)."""
from __future__ import annotations

import os
import threading


def lower_priority(nice: int) -> None:
    """Run the calling thread, and the threads and processes it starts, at nice `nice` or lower
    priority (Linux keeps a nice value per thread). Where it cannot be set, it runs as it was."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):
        pass
