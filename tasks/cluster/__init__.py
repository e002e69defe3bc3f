"""The job machinery every stage that runs on the cluster uses: the cluster's configuration and
presets (config), submitting and following a job and its arrays (jobs), how its tasks start
(launch), what is asked of SLURM (slurm), the run folder's record of its jobs (record), the run's
owner and its folder's lock (run_owner), a job's logs and environment (run_context), the hang
watch (hang) and the stacks of a hung job's ranks (stacks)."""
