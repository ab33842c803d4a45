"""KubeRay's names the operator reads and writes, and the annotations it reads on a RayCluster."""

from __future__ import annotations

from rlhfjob.api import GROUP, KUBERAY_GROUP

RAY_GROUP = KUBERAY_GROUP
RAY_VERSION = "v1"
RAY_API_VERSION = f"{RAY_GROUP}/{RAY_VERSION}"
RAY_CLUSTERS = "rayclusters"
RAY_CLUSTER_KIND = "RayCluster"

LABEL_CLUSTER = "ray.io/cluster"
"""On every pod of a RayCluster: the cluster's name."""
LABEL_NODE_TYPE = "ray.io/node-type"
"""``head`` or ``worker``."""
LABEL_GROUP = "ray.io/group"
"""A worker pod's group (one group per role)."""
NODE_HEAD = "head"
NODE_WORKER = "worker"

STATE_READY = "ready"
"""`status.state` once every pod was running and ready (it stays so)."""
CONDITION_HEAD_POD_READY = "HeadPodReady"

DASHBOARD_ANNOTATION = f"{GROUP}/dashboard-address"
"""Where the local stand-in Ray publishes a RayCluster's dashboard; read only by an operator
started with `--dev-dashboard-from-annotation` (dev and tests)."""
