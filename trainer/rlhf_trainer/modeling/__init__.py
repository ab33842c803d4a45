"""The networks: building them (saved ones partitioned under ZeRO-3), DeepSpeed's settings, and the
log-prob and entropy kernels every role runs."""
