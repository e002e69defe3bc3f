"""What the submitting process asks SLURM (scontrol, sinfo, scancel; sacct only as a fallback)."""
from __future__ import annotations

import logging
import re
import subprocess

log = logging.getLogger(__name__)

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


def run_command(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def slurm_state(job_id: str) -> tuple[str, str, str] | None:
    """(state, reason, nodelist) from scontrol, falling back to sacct; None when SLURM forgot it."""
    r = run_command(["scontrol", "show", "job", "-o", job_id])
    if r.returncode == 0 and r.stdout.strip():
        fields = dict(re.findall(r"(\w+)=(\S*)", r.stdout))
        nodes = fields.get("NodeList", "")
        return fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None"), "" if nodes == "(null)" else nodes
    r = run_command(["sacct", "-n", "-X", "-P", "-o", "State,Reason,NodeList", "-j", job_id])
    if r.returncode == 0 and r.stdout.strip():
        state, reason, nodes = (r.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return state.split()[0], reason, nodes
    return None


# sinfo's short node states of a node that can run a job (with no suffix such as "*": not responding).
USABLE_NODE_STATES = {"idle", "mix", "alloc", "comp", "resv", "plnd"}


def usable_nodes(partition: str | None) -> set[str] | None:
    """The nodes of ``partition`` (SLURM's default one when None) that can run a job now or once
    free; None when SLURM cannot be asked."""
    try:
        r = run_command(["sinfo", "-h", "-N", "-o", "%N %t %P"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    nodes = set()
    for line in r.stdout.splitlines():
        name, state, part = (line.split() + ["", "", ""])[:3]
        if (part.rstrip("*") == partition if partition else part.endswith("*")) and state in USABLE_NODE_STATES:
            nodes.add(name)
    return nodes


def scancel(job_id: str) -> None:
    r = run_command(["scancel", job_id])
    if r.returncode != 0:
        log.warning("scancel %s: %s", job_id, r.stderr.strip())


def requeued(job_id: str) -> bool:
    """A preempted job may come back (PreemptMode=REQUEUE): is it queued or running again?"""
    info = slurm_state(job_id)
    return info is not None and info[0] not in TERMINAL


def hostnames(hostlist: str | None) -> list[str]:
    """The node names of a SLURM hostlist (``node[1-3,7],gpu2``): scontrol expands the bracketed
    ones; where it cannot, the hostlist stays one entry, compared as written."""
    if not hostlist:
        return []
    if "[" not in hostlist:
        return hostlist.split(",")
    try:
        r = run_command(["scontrol", "show", "hostnames", hostlist])
    except (OSError, subprocess.SubprocessError):
        return [hostlist]
    return r.stdout.split() if r.returncode == 0 and r.stdout.strip() else [hostlist]
