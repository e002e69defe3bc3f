"""Goodput of a 1,000-node run on paper: resubmitting through the queue after every fault, against
restarting inside the allocation on spare nodes, with and without keeping bad nodes out.

A Monte Carlo simulation of one month of training. Faults arrive while the job trains at Llama 3's
published rate (Dubey et al., 2024, section 3.3.4: 419 unexpected interruptions in 54 days on 16,384
GPUs, 2,048 nodes of 8; 78% of them hardware). Each fault costs the allocation its detection, the
work since the last checkpoint (uniform over the interval), and getting going again:

- **resubmit**: SLURM's requeue hold, the wait in the queue, and the job's start (allocation, the
  checkpoint read, the process group);
- **in the allocation**: a new step on the healthy nodes and a spare (no hold, no queue), as long as
  a spare is left; a hardware fault takes its node out until it is repaired, a software fault's
  node comes back once restarted; without a spare, the resubmit path.

Without a quarantine, a node whose hardware fault the cluster's own health check missed can be given
to the job again at a resubmit, and fails again soon after; with one, it is excluded.

Goodput: node-hours of training kept (not redone) over node-hours held, spares included. Every
figure not published is a parameter, printed with the results: ``python -m benchmarks.goodput``
(``--help`` for them) prints JSON.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass

# Llama 3: 419 unexpected interruptions in 54 days on 2,048 nodes.
FAULTS_PER_NODE_HOUR = 419 / (54 * 24 * 2048)
HARDWARE_SHARE = 0.78


@dataclass(frozen=True)
class Setting:
    nodes: int = 1000
    days: float = 30.0
    checkpoint_interval_h: float = 0.5
    hang_share: float = 0.3              # faults found by the hang watch, not by a rank's exit
    hang_timeout_h: float = 10 / 60
    exit_detection_h: float = 1 / 60
    requeue_hold_h: float = 2 / 60       # SLURM's hold of a requeued job
    queue_wait_h: float = 1.0            # a busy cluster's queue for the whole allocation
    job_start_h: float = 5 / 60          # allocation, checkpoint read, process group
    step_start_h: float = 3 / 60         # a new srun step in the allocation: checkpoint read, process group
    repair_h: float = 24.0               # a node with a hardware fault, until it is back
    missed_by_health_check: float = 0.3  # hardware faults the cluster does not drain by itself
    repeat_fault_h: float = 2.0          # mean time to the next fault of such a node given back


def simulate(s: Setting, spares: int, in_allocation: bool, quarantine: bool, rng: random.Random) -> float:
    """One month's goodput."""
    end, now, kept = s.days * 24, 0.0, 0.0
    spare_back: list[float] = []          # when each spare taken by a hardware fault is back
    bad_given_back = 0                     # nodes of missed hardware faults in the allocation
    while now < end:
        rate = s.nodes * FAULTS_PER_NODE_HOUR + bad_given_back / s.repeat_fault_h
        run = rng.expovariate(rate)
        if now + run >= end:
            kept += end - now
            break
        now += run
        lost = min(run, rng.uniform(0, s.checkpoint_interval_h))
        kept += run - lost
        repeat = bad_given_back and rng.random() < (bad_given_back / s.repeat_fault_h) / rate
        hardware = repeat or rng.random() < HARDWARE_SHARE
        bad_given_back -= repeat
        down = s.hang_timeout_h if rng.random() < s.hang_share else s.exit_detection_h
        spare_back = [t for t in spare_back if t > now]
        if in_allocation and spares - len(spare_back) > 0:
            down += s.step_start_h
            if hardware:
                spare_back.append(now + s.repair_h)
        else:
            down += s.requeue_hold_h + s.queue_wait_h + s.job_start_h
            if hardware and not quarantine and rng.random() < s.missed_by_health_check:
                bad_given_back += 1
        now += down
    return kept * s.nodes / (end * (s.nodes + (spares if in_allocation else 0)))


def table(s: Setting, trials: int, seed: int) -> list[dict]:
    rows = []
    for quarantine in (False, True):
        ways = [("resubmit", 0, False)] + [("in the allocation", n, True) for n in (0, 1, 2, 4, 8, 16)]
        for way, spares, inside in ways:
            rng = random.Random(seed)
            runs = [simulate(s, spares, inside, quarantine, rng) for _ in range(trials)]
            rows.append({"restart": way, "spares": spares, "quarantine": quarantine,
                         "goodput": round(sum(runs) / trials, 4), "min": round(min(runs), 4),
                         "max": round(max(runs), 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.splitlines()[0])
    for name, value in asdict(Setting()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = vars(parser.parse_args(argv))
    trials, seed = args.pop("trials"), args.pop("seed")
    setting = Setting(**args)
    print(json.dumps({"setting": asdict(setting), "faults_per_node_hour": FAULTS_PER_NODE_HOUR,
                      "hardware_share": HARDWARE_SHARE, "trials": trials, "rows": table(setting, trials, seed)},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
