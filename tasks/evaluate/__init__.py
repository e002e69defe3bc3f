"""Evaluate stage: one checkpoint of a run, scored on its own job, never inside training.

records: what the run folder keeps (what it is evaluated on, the results, the saves pinned for
them); job: what the evaluation job runs (set perplexities, lm-evaluation-harness tasks); stage:
``evaluate_task``, which the evaluate flow calls. Where the job runs is the cluster preset's
evaluation settings (``ClusterConfig.eval_job``), or a local process with the local preset.
"""
