"""Nodes kept out across runs: the operator's list of the nodes a fault pointed at, with the
evidence, which every later plan on that cluster excludes until a burn-in (flows/burn_in.py) or the
operator releases them.

It is on where the operator's preset names its file (``quarantine: /path/quarantine.json``, a path
no form can set). Each verdict adds its node: a rank the others waited for in a hang, a rank named
a straggler. The file is JSON, ``{"nodes": {"node3": [verdict, ...]}}``, each verdict ``kind``
(hang, straggler, burn-in, operator), ``line`` (what was seen), ``run``, ``job``, ``evidence`` (a
path) and ``time``; it is rewritten whole under a lock by whoever adds or releases.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import time
from pathlib import Path
from typing import Any, Iterator

from gpt.files import write_json
from tasks.cluster.config import ClusterConfig
from tasks.cluster.slurm import hostnames
from tasks.common.run_context import run_logger

VERDICTS = ("hang", "rank lost", "straggler", "burn-in", "operator")


class QuarantineError(ValueError):
    """The quarantine file cannot be read as one: its path and what to do."""


class Quarantine:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, cluster: ClusterConfig) -> "Quarantine | None":
        return cls(cluster.quarantine) if cluster.quarantine else None

    def nodes(self) -> dict[str, list[dict[str, Any]]]:
        """Each node kept out, with its verdicts (oldest first)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise QuarantineError(f"quarantine {self.path}: {e.strerror}; check the preset's quarantine path") from None
        try:
            nodes = json.loads(text)["nodes"]
            assert isinstance(nodes, dict) and all(isinstance(v, list) for v in nodes.values())
        except (ValueError, KeyError, TypeError, AssertionError):
            raise QuarantineError(f"quarantine {self.path} is not a quarantine file ({{\"nodes\": {{node: [verdicts]}}}}): "
                                  "restore it, or remove it to start an empty one") from None
        return nodes

    def add(self, node: str, kind: str, line: str, *, run: str = "", job: str = "", evidence: str = "") -> None:
        """``node`` kept out from now on, for this verdict (its verdicts before stay)."""
        assert kind in VERDICTS, kind
        with self._locked() as nodes:
            nodes.setdefault(node, []).append({"kind": kind, "line": line, "run": run, "job": job,
                                               "evidence": evidence, "time": time.time()})

    def verdict(self, node: str, kind: str, line: str, **where: str) -> None:
        """A run's verdict added; where the file cannot take it, a warning: training goes on."""
        try:
            self.add(node, kind, line, **where)
        except (OSError, QuarantineError) as e:
            run_logger().warning("node %s could not be kept out by the quarantine %s: %s", node, self.path, e)

    def release(self, node: str, before: float | None = None) -> bool:
        """``node`` let back in, unless a verdict came at or after ``before`` (a burn-in's start);
        whether it was let back in."""
        with self._locked() as nodes:
            if before is not None and any(v["time"] >= before for v in nodes.get(node, [])):
                return False
            return nodes.pop(node, None) is not None

    def kept_out(self, cluster: ClusterConfig) -> tuple[ClusterConfig, list[str]]:
        """The cluster with the quarantined nodes excluded (a node list that names one keeps it, and
        says so), and a line per node saying why."""
        nodes = self.nodes()
        if not nodes:
            return cluster, []
        pinned = set(hostnames(cluster.nodelist))
        lines = [f"node {node} is kept out by the quarantine {self.path}: {why(verdicts[-1])}"
                 + (" (the cluster's nodelist names it: it stays in this run)" if node in pinned else "")
                 for node, verdicts in sorted(nodes.items())]
        excluded = sorted(set(hostnames(cluster.exclude)) | (set(nodes) - pinned))
        return cluster.model_copy(update={"exclude": ",".join(excluded) or None}), lines

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, list[dict[str, Any]]]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            nodes = self.nodes()
            yield nodes
            write_json(self.path, {"nodes": nodes})


def why(verdict: dict[str, Any]) -> str:
    """A verdict in one line: what was seen, and where its evidence is."""
    where = ", ".join(part for part in (f"run {verdict['run']}" if verdict.get("run") else "",
                                        f"job {verdict['job']}" if verdict.get("job") else "",
                                        verdict.get("evidence", "")) if part)
    return f"{verdict['kind']}: {verdict['line']}" + (f" ({where})" if where else "")
