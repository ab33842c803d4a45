"""What outlives a process: atomic checkpoints, state that loads on any number of ranks, and the
bucket tier."""
