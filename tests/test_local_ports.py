"""The local cluster's listening ports: chosen where no outgoing connection can take them, and a
component whose port another process holds is refused with the port named."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from rlhf_local import cluster, paths


def test_ports_are_chosen_below_the_kernels_ephemeral_range(tmp_path: Path) -> None:
    low, _ = paths.ephemeral_range()
    ports = paths.load_ports(tmp_path, cluster.PORT_NAMES)
    assert set(ports) == set(cluster.PORT_NAMES)
    assert len(set(ports.values())) == len(ports), "distinct"
    assert all(paths.LISTEN_FLOOR <= port < low for port in ports.values()), ports
    # Kept: the second load chooses nothing new.
    assert paths.load_ports(tmp_path, cluster.PORT_NAMES) == ports
    assert json.loads(paths.state_file(tmp_path).read_text())["ports"] == ports


def test_a_new_name_gets_a_port_no_recorded_name_has(tmp_path: Path) -> None:
    recorded = paths.load_ports(tmp_path, ["a", "b"])
    both = paths.load_ports(tmp_path, ["a", "b", "c"])
    assert {k: both[k] for k in ("a", "b")} == recorded
    assert both["c"] not in recorded.values()


def test_a_listening_port_is_not_free_and_a_closed_ones_connections_do_not_count() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not paths.port_is_free(port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its socket waits in TIME_WAIT
        client.close()
    assert paths.port_is_free(port)


def test_a_component_whose_port_is_taken_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster, "PORT_RELEASE_TIMEOUT", 0.5)
    layout = cluster.Layout(tmp_path)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(
            RuntimeError, match=rf"kube-scheduler cannot start.*kube-scheduler {port}"
        ):
            cluster._check_ports_free("kube-scheduler", layout, {"kube-scheduler": port})
    cluster._check_ports_free("kube-scheduler", layout, {"kube-scheduler": port})
