"""Setup shared by the trainer tests: every Ray they start (in this process, a `ray start` head,
or a driver's local Ray) gives its slow parts the time a busy machine needs.

A raylet aborts when its dashboard agent has not reported its ports within
`RAY_agent_register_timeout_ms` (Ray's default: seconds), and `ray start` gives up on its node
after `RAY_raylet_start_wait_time_s`; with a few Rays starting at once on two busy cores both
happen (the raylet's "WaitForDashboardAgentPorts" crash, then every driver's "Timed out while
waiting for GCS"). The same values as the e2e stand-in's Ray nodes.

Ray starts its workers at nice 15 (`RAY_worker_niceness`), meant to keep them behind the system
processes of a shared node. Here the workers are what a test waits for, and `task test` compiles
the control plane at nice 19 beside this tier to take only the CPU the tier leaves idle: against
nice 15 that compile takes about a third of each core (the unit tier ran 13.9 minutes cold against
9.3 warm), so the workers run at the tests' own priority.
"""

import os

os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
os.environ.setdefault("RAY_worker_niceness", "0")
