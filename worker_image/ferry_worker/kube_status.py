"""Report progress into `status.progress` of the ModelWeights a worker runs for.

The worker's ServiceAccount may patch only the status subresource, so this is
a JSON merge patch of `/status`, nothing else. Credentials: in-cluster service
account, else KUBECONFIG (the local executor). The official client is imported
only when this sink is used, so a worker that never reports to a cluster does
not pay for it.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from .progress import Snapshot

GROUP = "ferry.dev"
VERSION = "v1alpha1"
PLURAL = "modelweights"
MERGE_PATCH = "application/merge-patch+json"
# Default minimum seconds between two status patches (the last one always goes out).
DEFAULT_INTERVAL_S = 5.0


def progress_status(snapshot: Snapshot) -> dict[str, Any]:
    """`status.progress` as the CRD defines it."""
    body: dict[str, Any] = {
        "step": snapshot.step,
        "bytesDone": snapshot.bytes_done,
        "bytesTotal": snapshot.bytes_total,
        "bytesPerSecond": snapshot.bytes_per_second,
        "percent": snapshot.percent,
        "updatedAt": snapshot.updated_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    # A merge patch with null removes a stale ETA (unknown rate, or failed) instead of leaving the last one.
    body["etaSeconds"] = 0 if snapshot.finished else None if snapshot.failed else snapshot.eta_seconds
    return body


class ModelWeightsStatus:
    """Merge-patches the status subresource of one ModelWeights."""

    def __init__(self, name: str, namespace: str, custom_objects_api: Any) -> None:
        self.name = name
        self.namespace = namespace
        self._api = custom_objects_api

    @classmethod
    def connect(cls, name: str, namespace: str) -> "ModelWeightsStatus":
        from kubernetes import client, config

        # A configuration of its own: the client's process-wide default is left alone.
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            # KUBECONFIG read now, not when the client library was imported.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
        return cls(name, namespace, client.CustomObjectsApi(client.ApiClient(configuration)))

    def patch_progress(self, snapshot: Snapshot) -> None:
        self._api.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            self.name,
            {"status": {"progress": progress_status(snapshot)}},
            # Named in managedFields: who wrote the progress is visible.
            field_manager="ferry-worker",
            _content_type=MERGE_PATCH,
        )


class KubeStatusSink:
    """A progress sink that patches at most every `interval_s` seconds, and
    not at all for a step that ends within its first interval: the operator
    records the step's end itself, and a worker that never patches never
    imports the Kubernetes client (most of a tiny step's CPU time)."""

    def __init__(
        self, connect: Callable[[], ModelWeightsStatus], interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect  # called on the first patch
        self._status: ModelWeightsStatus | None = None
        self._interval_s = interval_s
        self._clock = clock
        self._started = clock()
        self._last: float | None = None

    @classmethod
    def from_env(cls, name: str, namespace: str) -> "KubeStatusSink":
        interval = float(os.environ.get("FERRY_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
        return cls(lambda: ModelWeightsStatus.connect(name, namespace), interval)

    def _patch(self, snapshot: Snapshot) -> None:
        if self._status is None:
            self._status = self._connect()
        self._status.patch_progress(snapshot)

    def publish(self, snapshot: Snapshot) -> None:
        now = self._clock()
        if now - (self._last if self._last is not None else self._started) < self._interval_s:
            return
        self._last = now
        self._patch(snapshot)

    def close(self, snapshot: Snapshot) -> None:
        # The last state of a progress someone could have seen; nothing for a
        # step that ended within its first interval.
        if self._last is not None or self._clock() - self._started >= self._interval_s:
            self._patch(snapshot)
