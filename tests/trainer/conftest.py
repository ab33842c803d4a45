"""Setup shared by the trainer tests: every Ray they start (in this process, a `ray start` head,
or a driver's local Ray) gives its slow parts the time a busy machine needs.

A raylet aborts when its dashboard agent has not reported its ports within
`RAY_agent_register_timeout_ms` (Ray's default: seconds), and `ray start` gives up on its node
after `RAY_raylet_start_wait_time_s`; with a few Rays starting at once on two busy cores both
happen (the raylet's "WaitForDashboardAgentPorts" crash, then every driver's "Timed out while
waiting for GCS"). The same values as the e2e stand-in's Ray nodes.
"""

import os

os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
