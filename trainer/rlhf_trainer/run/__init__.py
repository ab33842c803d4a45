"""One run: the driver process, its start-up, the training loop and its parts, the heartbeat and the
metrics."""
