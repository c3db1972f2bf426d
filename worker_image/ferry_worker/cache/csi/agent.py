"""`ferry cache agent`: the node agent of the chart's DaemonSet. One gRPC
server on two unix sockets under the kubelet's directory: the CSI driver's
(<kubelet>/plugins/cache.ferry.dev/csi.sock) and the registration socket the
kubelet watches (<kubelet>/plugins_registry/cache.ferry.dev-reg.sock). Its
one write to the API server is its own node's cache labels (node_labels.py),
with the pod-bound token the kubelet projects; without a token it labels
nothing and serves all the same."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from ... import __version__
from ..store import CacheStore
from .driver import DRIVER, IdentityService, NodeService
from .proto import csi_pb2_grpc, pluginregistration_pb2_grpc
from .registration import Registration
from ..node_labels import NodeLabeler
from ...pod_status import STANDARD_TOKEN_DIR, connect

log = logging.getLogger(__name__)
SCRUB_LOOK_S = 600.0


def sockets(kubelet_dir: Path) -> tuple[Path, Path]:
    """(the driver's socket, the registration socket) under the kubelet's directory."""
    return (kubelet_dir / "plugins" / DRIVER / "csi.sock",
            kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock")


def start(store: CacheStore, kubelet_dir: Path, node_name: str, mount_wait: float) -> grpc.Server:
    """The agent's server, started: stale sockets of an earlier agent replaced, volumes that ended while
    no agent ran finished (store.adopt / release) before the kubelet can call."""
    node = NodeService(store, node_name, mount_wait)
    node.recover()
    csi_sock, reg_sock = sockets(kubelet_dir)
    server = grpc.server(ThreadPoolExecutor(max_workers=16, thread_name_prefix="csi"))
    csi_pb2_grpc.add_NodeServicer_to_server(node, server)
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(__version__), server)
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(Registration(DRIVER, str(csi_sock)), server)
    for sock in (csi_sock, reg_sock):
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        server.add_insecure_port(f"unix://{sock}")
    server.start()
    log.info("serving %s on %s for node %s (cache %s, high %d, low %d, keeps %d bytes of the disk free)",
             DRIVER, csi_sock, node_name, store.root, store.marks.high, store.marks.low, store.marks.keep_free)
    return server


def labeler(store: CacheStore, node_name: str, token_dir: Path = STANDARD_TOKEN_DIR) -> NodeLabeler | None:
    """The node's cache labeller, if the agent has a token; else None (the agent serves all the same, and
    the operator's pods get no preference)."""
    if not (token_dir / "token").is_file():
        log.warning("no service account token in %s: node %s gets no cache labels", token_dir, node_name)
        return None
    core_api, _ = connect(token_dir)
    node_labels = NodeLabeler(store, node_name, core_api)
    store.on_change = node_labels.changed
    return node_labels


def scrubber(store: CacheStore, every: float, stop: threading.Event) -> None:
    """Until `stop`: look every SCRUB_LOOK_S (or `every`, if shorter) for entries not verified within
    `every` seconds, and read them again (store.scrub)."""
    while not stop.wait(min(every, SCRUB_LOOK_S)):
        try:
            store.scrub(every)
        except Exception:  # noqa: BLE001 - a disk error on one pass: said, and tried at the next
            log.exception("scrub pass failed; trying again in %.0f s", min(every, SCRUB_LOOK_S))


def serve(store: CacheStore, kubelet_dir: Path, node_name: str, mount_wait: float, scrub_every: float = 0.0) -> int:
    stop = threading.Event()
    node_labels = labeler(store, node_name)
    server = start(store, kubelet_dir, node_name, mount_wait)
    if node_labels is not None:
        threading.Thread(target=node_labels.run, args=(stop,), name="node-labels", daemon=True).start()
    if scrub_every > 0:
        threading.Thread(target=scrubber, args=(store, scrub_every, stop), name="scrub", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping; mounted entries stay mounted (they live in the host's mount namespace)")
    server.stop(grace=5).wait()
    for sock in sockets(kubelet_dir):
        sock.unlink(missing_ok=True)  # the kubelet deregisters the driver when its socket goes
    return 0
