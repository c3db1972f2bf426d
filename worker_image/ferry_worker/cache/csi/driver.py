"""The CSI driver `cache.ferry.dev`: Identity and Node services over the
cache store, for ephemeral inline volumes (the kubelet publishes one per pod
volume and unpublishes it when the pod goes; there is no controller).

A pod's volume attributes say what it wants:

    digest: sha256:<hex>      the artifact's manifest digest (required)
    ranks:  "0,1"             only these ranks' files (sharded_state), optional
    mode:   serve | fill      serve (default): the complete entry, verified, read-only
                              fill: the entry's slot, for the one fill pod of it
    bytes:  "<n>"             fill: the bytes the fill will write (room is made first)

Every published volume is recorded under <cache>/volumes/, so a restarted
agent knows which pods hold which entries and which fills ended while it was
down (`recover`)."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import grpc

from ...manifest import IntegrityError, atomic_file
from ..store import CacheError, CacheFull, CacheStore, CorruptEntry, cache_key
from . import mounts
from .proto import csi_pb2, csi_pb2_grpc

log = logging.getLogger(__name__)

DRIVER = "cache.ferry.dev"
POD = "csi.storage.k8s.io/pod."
# Publishes of an absent entry that may wait for it at once (of the server's 16 threads), one per pod: any
# more fail fast with Unavailable (the kubelet retries). Pods asking for digests no fill will bring hold no
# more than these, so a present entry still mounts at once.
MAX_WAITING = 4


class NodeService(csi_pb2_grpc.NodeServicer):
    def __init__(self, store: CacheStore, node_name: str, mount_wait: float = 30.0):
        self.store, self.node_name, self.mount_wait = store, node_name, mount_wait
        self.records = store.root / "volumes"
        self.records.mkdir(exist_ok=True)
        self._fills = threading.Lock()
        # A publish that outlasts the kubelet's call (verifying a large entry) must not be started twice.
        self._busy: set[str] = set()
        self._busy_lock = threading.Lock()
        self._waiting: set[str] = set()  # the pods whose publish waits for an absent entry

    # -- the kubelet's calls ---------------------------------------------------------------------------------
    def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_name)

    def NodeGetCapabilities(self, request, context):
        return csi_pb2.NodeGetCapabilitiesResponse()  # no staging, no stats: publish and unpublish only

    def NodePublishVolume(self, request, context):
        with self._busy_lock:
            if request.volume_id in self._busy:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"volume {request.volume_id} is still being published "
                                                           f"(its entry is being verified): the kubelet retries")
            self._busy.add(request.volume_id)
        try:
            self._publish(request)
        except grpc.RpcError:
            raise
        except _Refused as e:
            log.warning("refused volume %s for pod %s: %s", request.volume_id, _pod(request), e.message)
            context.abort(e.code, e.message)
        finally:
            with self._busy_lock:
                self._busy.discard(request.volume_id)
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request, context):
        record = self._record(request.volume_id)
        target = Path(request.target_path)
        if mounts.is_mount(target):
            mounts.unmount(target)
        if target.is_dir():
            os.rmdir(target)
        if record:
            self._finish(request.volume_id, record)
        return csi_pb2.NodeUnpublishVolumeResponse()

    # -- publish -------------------------------------------------------------------------------------------------
    def _publish(self, request) -> None:
        attrs = request.volume_context
        if attrs.get("csi.storage.k8s.io/ephemeral", "true") != "true":
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{DRIVER} serves ephemeral inline volumes only")
        try:
            key = cache_key(attrs.get("digest", ""), _ranks(attrs.get("ranks")))
        except (CacheError, ValueError) as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"volumeAttributes: {e}") from None
        mode = attrs.get("mode", "serve")
        target = Path(request.target_path)
        if mounts.is_mount(target):
            if self._record(request.volume_id).get("target") == str(target):
                return  # published already: the kubelet retried a call whose answer it lost
            mounts.unmount(target)  # a mount with no record (an agent killed in between): start again
        how = ""
        if mode == "serve":
            self._await_entry(key, _pod(request))
            source, verified = self._entry_for(key, request.volume_id)
            how = (" (every byte verified)" if verified else
                   f" (verified within {self.store.reverify_after:.0f} s, its files unchanged since)")
        elif mode == "fill":
            source, mode = self._slot_for(key, request.volume_id, attrs.get("bytes", ""), attrs.get(POD + "namespace", ""))
        else:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"volumeAttributes.mode {mode!r}: serve or fill")
        record = {"key": key, "mode": mode, "target": str(target), "pod": _pod(request),
                  "bytes": attrs.get("bytes", "")}
        # Recorded before the mount: an agent killed in between finds the target and knows it is live.
        self._write_record(request.volume_id, record)
        target.mkdir(parents=True, exist_ok=True)
        try:
            mounts.bind(source, target, read_only=mode == "serve")
        except OSError:
            self._finish(request.volume_id, {**record, "mode": "serve" if mode == "serve" else "abandoned"})
            raise
        log.info("%s %s for pod %s at %s%s", "serving (read-only)" if mode == "serve" else "fill slot of", key,
                 _pod(request), target, how)

    def _await_entry(self, key: str, pod: str) -> None:
        """Wait (at most mount_wait) for an absent entry: one waiting publish per pod, MAX_WAITING in all;
        beyond that, or after the wait, Unavailable (the kubelet retries)."""
        if self.store.entry(key) is not None:
            return
        absent = f"no cache entry {key} on node {self.node_name} yet: its fill pod has not finished"
        with self._busy_lock:
            full = pod in self._waiting or len(self._waiting) >= MAX_WAITING
            if not full:
                self._waiting.add(pod)
        if full:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"{absent}; {MAX_WAITING} mounts already wait for "
                                                        f"absent entries on this node (the kubelet retries)")
        try:
            deadline = time.monotonic() + self.mount_wait
            while self.store.entry(key) is None:
                if time.monotonic() >= deadline:
                    raise _Refused(grpc.StatusCode.UNAVAILABLE, f"{absent} (the kubelet retries this mount)")
                time.sleep(0.5)
        finally:
            with self._busy_lock:
                self._waiting.discard(pod)

    def _entry_for(self, key: str, holder: str) -> tuple[Path, bool]:
        if self.store.entry(key) is None:  # evicted since it was awaited
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"no cache entry {key} on node {self.node_name} "
                                                        f"(the kubelet retries this mount)")
        self._write_record(holder, {"key": key, "mode": "serve"})  # held from here: never evicted under us
        try:
            return self.store.mount_entry(key, holder)
        except IntegrityError as e:
            self._drop_record(holder)
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"cache entry {key} on node {self.node_name} is corrupt: "
                                                      f"removed (or, while other pods have it mounted, removed as "
                                                      f"they let go), and the next fill fetches it again: {e}")
        except CacheError as e:
            self._drop_record(holder)
            raise _Refused(grpc.StatusCode.UNAVAILABLE, str(e))

    def _slot_for(self, key: str, holder: str, nbytes: str, namespace: str) -> tuple[Path, str]:
        """The slot to fill, or (filled meanwhile) the entry itself read-only: the fill pod finds it complete."""
        if not nbytes.isdigit() or int(nbytes) == 0:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"volumeAttributes.bytes {nbytes!r}: the bytes the "
                                                             f"fill writes, a positive whole number")
        if not namespace and self.store.fairness.namespace_share:  # fail closed: no namespace, no share
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"no {POD}namespace in the volume context: the "
                                                             f"CSIDriver {DRIVER} must have podInfoOnMount: true")
        if self.store.entry(key) is not None:
            self._write_record(holder, {"key": key, "mode": "serve"})
            try:
                return self.store.acquire(key, holder), "serve"
            except CorruptEntry as e:  # it cannot be refilled until it is gone
                self._drop_record(holder)
                raise _Refused(grpc.StatusCode.UNAVAILABLE, f"node {self.node_name}: {e}")
            except CacheError:
                self._drop_record(holder)  # evicted this instant: a slot, then

        with self._fills:  # the kubelet publishes pods' volumes concurrently: one claims the slot
            other = [v for v, r in self._records() if r.get("key") == key and r.get("mode") == "fill" and v != holder]
            if other:
                raise _Refused(grpc.StatusCode.ABORTED, f"{key} is being filled by another pod (volume {other[0]}) "
                                                        f"on node {self.node_name}: one fill per entry")
            self._write_record(holder, {"key": key, "mode": "fill", "bytes": nbytes})
        try:
            return self.store.slot(key, int(nbytes), namespace), "fill"
        except CacheFull as e:
            self._drop_record(holder)
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node {self.node_name}: {e}")

    # -- unpublish ---------------------------------------------------------------------------------------------
    def _finish(self, volume_id: str, record: dict) -> None:
        """A pod let go of its volume: release the entry it held, or adopt the slot it filled."""
        key = record["key"]
        if record["mode"] == "serve":
            self.store.release(key, volume_id)
        elif record["mode"] == "fill":
            try:
                self.store.adopt(key, int(record.get("bytes") or 0))
                log.info("published %s from the fill of pod %s", key, record.get("pod", "?"))
            except (CacheError, IntegrityError, OSError) as e:
                # Unpublish itself succeeds (the pod is gone either way); the entry stays absent, so serving
                # mounts keep waiting and the next fill pod resumes from what was kept.
                log.warning("not published: %s", e)
        self._drop_record(volume_id)

    def recover(self) -> None:
        """At start: a volume whose mount is gone ended while the agent was down (its pod left and the
        kubelet's unpublish found no driver): finish it now. Mounted ones stay held."""
        for volume_id, record in self._records():
            try:
                target = record.get("target")
                if target and mounts.is_mount(Path(target)):
                    if record["mode"] == "serve":
                        self.store.acquire(record["key"], volume_id)
                    continue
                log.info("volume %s (%s of %s) ended while the agent was down", volume_id, record["mode"],
                         record["key"])
                self._finish(volume_id, record)
            except (CacheError, OSError) as e:  # one bad record must not keep the agent from serving the rest
                log.error("volume %s: %s", volume_id, e)

    # -- records ----------------------------------------------------------------------------------------------
    def _record(self, volume_id: str) -> dict:
        try:
            return json.loads((self.records / f"{_safe(volume_id)}.json").read_text())
        except FileNotFoundError:
            return {}

    def _records(self):
        for path in sorted(self.records.glob("*.json")):
            yield path.stem, json.loads(path.read_text())

    def _write_record(self, volume_id: str, record: dict) -> None:
        with atomic_file(self.records / f"{_safe(volume_id)}.json") as f:
            f.write(json.dumps(record).encode())

    def _drop_record(self, volume_id: str) -> None:
        (self.records / f"{_safe(volume_id)}.json").unlink(missing_ok=True)


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def __init__(self, version: str):
        self.version = version

    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=DRIVER, vendor_version=self.version)

    def GetPluginCapabilities(self, request, context):
        return csi_pb2.GetPluginCapabilitiesResponse()  # node only: no controller, no topology

    def Probe(self, request, context):
        return csi_pb2.ProbeResponse()  # unset `ready`: ready


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _ranks(text: str | None) -> list[int] | None:
    return [int(r) for r in text.split(",")] if text else None


def _pod(request) -> str:
    attrs = request.volume_context
    return f"{attrs.get(POD + 'namespace', '?')}/{attrs.get(POD + 'name', '?')}"


def _safe(volume_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}", volume_id):
        raise ValueError(f"volume id {volume_id!r} is not a plain name")
    return volume_id
