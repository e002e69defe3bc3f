"""The job machinery every stage that runs on the cluster uses: the cluster's configuration and
presets (config), submitting and following a job and its arrays (jobs), the run's owner and its
folder's lock (run_owner), a job's logs and environment (run_context), and the hang watch (hang)."""
