"""The lifecycle policy: what was observed in, the next phase and actions out (decision 2).

A pure function, so every transition is a row in a table-driven test. The reconciler gathers an
`Observed` snapshot (`views`), calls `decide`, and carries out the `Plan`: server-side applies,
Ray job submissions, status patches and Events. What happens while carrying it out (a submission
that fails) is observed and decided again, never patched into a plan. Running it twice on the
same world plans the same thing; that, with idempotent actions, is what makes reconciliation
level-triggered.

The phases, in order of a healthy job: Pending → Provisioning → Running → Succeeded. Failures of
the trainer lead to Recovering (the recovery ladder of decision 5) and, when retrying cannot help
or the restart budget is spent, to Failed. Suspended releases the cluster and keeps checkpoints.
Succeeded and Failed are terminal: nothing brings a job back from them.

What keeps a cluster from coming up shows on the job one way, whoever says it: the ClusterReady
condition's reason names the kind of cause (`ApplyRefused`, `ClusterRejected`,
`PodCreationFailed`, `Unschedulable`, `ContainersNotStarting`) and its message, like the job's,
quotes the cause in its source's own words. A cause retrying cannot fix fails the job at once
(an object the API server or KubeRay refused) or after `PERMANENT_FAILURE_GRACE_SECONDS` (pods
refused by Pod Security or validation); any other cause, the kubelet's included (it retries a
missing Secret itself), is waited out until `provisioningTimeoutSeconds`.

The policy in layers, each importing only those above it: `plan` (what to do: actions,
Events, condition names), `builder` (the status being edited and its helpers), `shared` (the
steps every rung may take: finish, restart, recreate), a module per step (`reports`, `drain`,
`scaling`, `admission`, `training`, `provisioning`, `ending`), and `ladder` (`decide`: which
step applies, in priority order).
"""

from rlhf_operator.lifecycle.drain import DRAIN_POLL_SECONDS
from rlhf_operator.lifecycle.ladder import LADDER, Rung, decide
from rlhf_operator.lifecycle.plan import (
    CLUSTER_READY,
    Action,
    ApplyCluster,
    ApplyWorkload,
    ClearStopRequest,
    DeleteCluster,
    DeleteJob,
    Event,
    FinishWorkload,
    Plan,
    ReleaseQuota,
    RequestStop,
    SetPodsReady,
    SetWorkloadActive,
    StopRayJob,
    SubmitRayJob,
)
from rlhf_operator.lifecycle.provisioning import dashboard_retry_at
from rlhf_operator.lifecycle.shared import backoff_seconds, restart_delay
from rlhf_operator.lifecycle.training import trainer_failure_summary
from rlhf_operator.texts import MESSAGE_LIMIT

__all__ = [
    "CLUSTER_READY",
    "DRAIN_POLL_SECONDS",
    "LADDER",
    "MESSAGE_LIMIT",
    "Action",
    "ApplyCluster",
    "ApplyWorkload",
    "ClearStopRequest",
    "DeleteCluster",
    "DeleteJob",
    "Event",
    "FinishWorkload",
    "Plan",
    "ReleaseQuota",
    "RequestStop",
    "Rung",
    "SetPodsReady",
    "SetWorkloadActive",
    "StopRayJob",
    "SubmitRayJob",
    "backoff_seconds",
    "dashboard_retry_at",
    "decide",
    "restart_delay",
    "trainer_failure_summary",
]
