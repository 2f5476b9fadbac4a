"""The ``kvxfer-bench`` CLI: producer and consumer in two processes, side by side with raw baselines."""
