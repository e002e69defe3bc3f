"""The `burn-in` flow: each node a cluster's quarantine keeps out -> a health job on it -> let back
in if it passes, kept out with the new evidence if not.

    python -m flows.burn_in --cluster p5-operator                  # every quarantined node
    python -m flows.burn_in --cluster p5-operator --release node7  # by hand: let node7 back in
    python -m flows.burn_in --cluster p5-operator --add node9 --reason "ECC errors in dmesg"

The health job (tasks/burn_in.py) runs the preset's `burn_in_checks` on the node, then a short
training job of the tiny model there, timed against a node outside the quarantine. Only the
operator's preset turns a quarantine on (`quarantine: <file>`); this flow releases only the nodes
that pass, and adding or releasing by hand is the command line's, where the operator runs it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.cli import exit_status
from flows.plan.boundary import Boundary
from flows.plan.params import ParameterError, refused_as_failed_run
from tasks.burn_in import Health, node_health
from tasks.cluster.config import ClusterConfig, load_cluster
from tasks.cluster.quarantine import Quarantine
from tasks.cluster.slurm import usable_nodes
from tasks.common.run_context import run_logger


def quarantined_cluster(preset: str) -> tuple[ClusterConfig, Quarantine]:
    """The operator's preset ``preset`` and the quarantine it keeps, or the parameter refused."""
    try:
        cluster = load_cluster(preset, dirs=Boundary.from_env().presets)
    except (ValueError, OSError) as e:
        raise ParameterError([f"cluster: {e}"]) from None
    quarantine = Quarantine.of(cluster)
    if quarantine is None or cluster.kind != "slurm":
        raise ParameterError([f"cluster: preset {preset!r} keeps no quarantine of SLURM nodes; the operator turns "
                              "one on with `quarantine: <file>` in a SLURM preset"])
    return cluster, quarantine


@flow(name="burn-in", log_prints=True)
@refused_as_failed_run
def burn_in(cluster: str, iterations: int = 20) -> dict:
    """Run a health job on every node the cluster's quarantine keeps out, and let back in those that
    pass: the preset's burn_in_checks exit 0, a short training job there completes, and its time per
    iteration is within 1.5x that of a node outside the quarantine.

    Args:
        cluster: The operator's cluster preset whose quarantine is burnt in.
        iterations: Training iterations of each node's health job.
    """
    where, quarantine = quarantined_cluster(cluster)
    started, nodes = time.time(), sorted(quarantine.nodes())
    folder = quarantine.path.parent / "burn-in"
    healthy = sorted((usable_nodes(where.partition) or set()) - set(nodes))
    reference = node_health(healthy[0], where, folder, iterations) if nodes and healthy else None
    found = [settled(node_health(node, where, folder, iterations).compared(reference), quarantine, started, folder)
             for node in nodes]
    _show(found, reference)
    return {"released": [h.node for h in found if not h.problems],
            "kept": {h.node: list(h.problems) for h in found if h.problems}}


def settled(health: Health, quarantine: Quarantine, started: float, folder: Path) -> Health:
    """The node's burn-in written to the quarantine: kept out with what it showed, or let back in
    unless a run kept it out again meanwhile."""
    if health.problems:
        quarantine.add(health.node, "burn-in", "; ".join(health.problems), evidence=str(folder))
    elif not quarantine.release(health.node, before=started):
        return Health(health.node, ("a run kept it out again while its burn-in ran",), health.ms_per_iteration)
    return health


def _show(found: list[Health], reference: Health | None) -> None:
    logger = run_logger()
    for h in found:
        logger.info("node %s: %s", h.node, "; ".join(h.problems) if h.problems else "passed: let back in")
    rows = [{"node": h.node, "verdict": "kept out" if h.problems else "let back in",
             "ms per iteration": f"{h.ms_per_iteration:.0f}" if h.ms_per_iteration else "",
             "why": "; ".join(h.problems)} for h in found]
    if reference is not None:
        rows.append({"node": reference.node, "verdict": "reference (outside the quarantine)",
                     "ms per iteration": f"{reference.ms_per_iteration or 0:.0f}", "why": "; ".join(reference.problems)})
    create_table_artifact(rows, key="burn-in", description="the quarantined nodes' health jobs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.burn_in", description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True, help="the operator's cluster preset that keeps the quarantine")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--release", metavar="NODE", help="let NODE back in by hand (no health job)")
    p.add_argument("--add", metavar="NODE", help="keep NODE out by hand, with --reason")
    p.add_argument("--reason", default="", help="why --add keeps the node out")
    a = p.parse_args(argv)

    def run() -> int:
        if a.release or a.add:
            return _by_hand(a.cluster, a.release, a.add, a.reason)
        from flows.local_server import ensure_api

        ensure_api()        # without PREFECT_API_URL: a temporary server that ends with this process
        result = burn_in(a.cluster, a.iterations)
        print(f"let back in: {', '.join(result['released']) or 'none'}; kept out: "
              + ("; ".join(f"{n} ({', '.join(why)})" for n, why in result["kept"].items()) or "none"))
        return 0
    return exit_status("burn-in", run)


def _by_hand(preset: str, release: str | None, add: str | None, reason: str) -> int:
    _, quarantine = quarantined_cluster(preset)
    if add:
        if not reason:
            raise ParameterError(["--add: say why the node is kept out with --reason"])
        quarantine.add(add, "operator", reason)
        print(f"node {add} kept out by {quarantine.path}")
    if release:
        print(f"node {release} let back in" if quarantine.release(release) else
              f"node {release} was not in {quarantine.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
