"""Where the local cluster keeps things: binaries in a per-user cache, state in the repo.

``RLHF_CACHE_DIR`` (default ``~/.cache/rlhfjob``) holds compiled binaries keyed by version so
that a fresh clone reuses them. ``RLHF_LOCAL_DIR`` (default ``<repo>/.local/cluster``) holds a
running cluster's certificates, kubeconfigs, logs and pid files; it is gitignored.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The e2e/ directory of the repository (this package lives in e2e/rlhf_local).
E2E_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = E2E_DIR.parent


def cache_dir() -> Path:
    """Root of the binary cache, shared by every clone on this machine."""
    env = os.environ.get("RLHF_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "rlhfjob"


def local_dir() -> Path:
    """State directory of the local cluster (certs, kubeconfig, logs, pids, etcd data)."""
    env = os.environ.get("RLHF_LOCAL_DIR")
    return Path(env).resolve() if env else REPO_ROOT / ".local" / "cluster"


def kubeconfig_path() -> Path:
    """Admin kubeconfig of the local cluster (client certificate in system:masters)."""
    return local_dir() / "kubeconfig"
