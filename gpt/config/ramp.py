"""Batch-size ramp-up as Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES`` defines it:
the global batch starts at START and grows by INCREMENT in equal shares of the first SAMPLES
samples, reaching the run's global batch size once they are consumed."""
from __future__ import annotations

import functools
import itertools


def batch_size_at(consumed: int, ramp: tuple[int, int, int], global_batch_size: int) -> int:
    """The global batch of the step that starts once ``consumed`` samples are trained."""
    start, increment, samples = ramp
    increments = (global_batch_size - start) // increment
    if consumed > samples or increments == 0:
        return global_batch_size
    return min(global_batch_size, start + int(consumed / (samples / increments)) * increment)


@functools.lru_cache(maxsize=8)
def ramp_batches(ramp: tuple[int, int, int], global_batch_size: int) -> tuple[int, ...]:
    """The global batch of each step that starts within the ramp (while at most SAMPLES samples are
    consumed), in order."""
    batches, consumed = [], 0
    while consumed <= ramp[2]:
        batches.append(batch_size_at(consumed, ramp, global_batch_size))
        consumed += batches[-1]
    return tuple(batches)


@functools.lru_cache(maxsize=8)
def _consumed(ramp: tuple[int, int, int], global_batch_size: int) -> tuple[int, ...]:
    """Samples consumed once each step of the ramp is done (0 before the first)."""
    return (0, *itertools.accumulate(ramp_batches(ramp, global_batch_size)))


def samples_after(iterations: int, ramp: tuple[int, int, int] | None, global_batch_size: int) -> int:
    """Samples consumed once ``iterations`` steps are done."""
    if ramp is None:
        return iterations * global_batch_size
    consumed = _consumed(tuple(ramp), global_batch_size)
    within = min(iterations, len(consumed) - 1)
    return consumed[within] + (iterations - within) * global_batch_size


def iterations_for(samples: int, ramp: tuple[int, int, int] | None, global_batch_size: int) -> int:
    """Steps a run of ``samples`` samples takes (Megatron's count: the ramp's steps that start within
    the run, then whole global batches; a last partial batch is not trained)."""
    if ramp is None:
        return samples // global_batch_size
    iterations, consumed = 0, 0
    for batch in ramp_batches(tuple(ramp), global_batch_size):
        if consumed > samples:
            break
        consumed += batch
        iterations += 1
    return iterations + max(0, samples - consumed) // global_batch_size
