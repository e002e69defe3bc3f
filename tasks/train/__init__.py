"""The train stage: the training job submitted and followed, its metrics tailed into progress and
artifacts (stage), and the experiment trackers it logs to (trackers)."""
