"""`ferry cache agent`: the node agent of the chart's DaemonSet. One gRPC
server on two unix sockets under the kubelet's directory: the CSI driver's
(<kubelet>/plugins/cache.ferry.dev/csi.sock) and the registration socket the
kubelet watches (<kubelet>/plugins_registry/cache.ferry.dev-reg.sock). It
talks to nothing but its own kubelet: no API access, no token."""
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

log = logging.getLogger(__name__)


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


def serve(store: CacheStore, kubelet_dir: Path, node_name: str, mount_wait: float) -> int:
    server = start(store, kubelet_dir, node_name, mount_wait)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping; mounted entries stay mounted (they live in the host's mount namespace)")
    server.stop(grace=5).wait()
    for sock in sockets(kubelet_dir):
        sock.unlink(missing_ok=True)  # the kubelet deregisters the driver when its socket goes
    return 0
