"""A namespaced operator does not scan the cluster, and starts again when an optional CRD comes or goes.

kopf follows namespaces and CRDs as they come and go by listing and watching them. A namespaced install may
not list namespaces (charts/ferry/templates/rbac.yaml: nothing cluster-wide beyond a few reads), and kopf 1.45
retries a forbidden request 9 times (1+1+2+3+5+8+13+21 s) before it falls back to the names it was given: the
operator reconciled nothing for the first 54 s of every start (install, upgrade, eviction). With exact
namespace names there is nothing to follow, so `ferry-operator run --namespace=...` turns kopf's scanning off
(`settings.scanning.disabled`, kopf's documented restricted mode): it watches the namespaces as given from the
first second, and never asks for namespaces (tests/node/test_prepare_on_node.py reads the audit log for that).

What scanning off costs: kopf watches the kinds it found at the start, and no other, until the next start. Of
the kinds Ferry watches, a cluster may install one later, or remove it: LeaderWorkerSet. So the operator
records at startup whether its CRD was established, and when that changes it stops, and the CLI starts it
again (cli.py), now watching what is there. Watching all namespaces, kopf follows CRDs itself and nothing here
acts. (A SIGTERM in the few seconds kopf takes to stop is kopf's, and lost: the new start then runs until the
pod's grace period ends. The chart's Recreate strategy starts no second operator beside it.)
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from .indexes import LWS

log = logging.getLogger("ferry_operator")
# The CRDs of the kinds Ferry watches that a cluster may lack.
OPTIONAL_CRDS = frozenset({f"{LWS.plural}.{LWS.group}"})
# Optional CRD -> established at startup (only with scanning off); None: unknown, the first event tells.
_at_start: dict[str, bool | None] = {}
_stop: asyncio.Event | None = None


def stop_flag() -> asyncio.Event:
    """A new flag for `kopf.run(stop_flag=...)`, for one run: set when an optional CRD came or went."""
    global _stop
    _stop = asyncio.Event()
    return _stop


def restart_asked() -> bool:
    return _stop is not None and _stop.is_set()


def established(crd: Mapping[str, Any] | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def reader(api: Any) -> Callable[[str], dict[str, Any] | None]:
    """`read_crd` for note_at_start, through an ApiextensionsV1Api: None for a CRD that does not exist."""
    def read_crd(name: str) -> dict[str, Any] | None:
        try:
            return api.read_custom_resource_definition(name).to_dict()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
    return read_crd


def note_at_start(read_crd: Callable[[str], Mapping[str, Any] | None]) -> dict[str, bool | None]:
    """At startup, with scanning off: which optional CRDs are established, so watched. `read_crd(name)` returns
    the CRD, or None when it does not exist. One that cannot be read is unknown: the watch's first event says
    what kopf found (a start that cannot read it would otherwise start again at once, and again)."""
    _at_start.clear()
    for name in sorted(OPTIONAL_CRDS):
        try:
            _at_start[name] = established(read_crd(name))
        except Exception as exc:  # noqa: BLE001 - logged; the watch's first event settles it
            log.warning("CRD %s could not be read (%s): its first watch event says whether it is watched", name, exc)
            _at_start[name] = None
            continue
        if not _at_start[name]:
            log.warning("CRD %s is not installed: its kind is not watched. Once it is, the operator starts again "
                        "to watch it (a namespaced operator does not follow CRDs)", name)
    return dict(_at_start)


def restart_for(name: str, crd: Mapping[str, Any], event_type: str | None) -> bool:
    """Whether this CRD event asks for a new start: the CRD is now established where it was not at startup, or
    the other way round (deleted, or no longer served)."""
    if name not in _at_start:
        return False  # scanning on: kopf follows it
    now = event_type != "DELETED" and established(crd)
    if _at_start[name] is None:  # unread at startup: kopf's scan, just before this watch, saw the same
        _at_start[name] = now
        return False
    return _at_start[name] != now


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions",
               when=lambda name, **_: name in OPTIONAL_CRDS)
async def optional_crd_changed(name: str, body: kopf.Body, type: str | None, **_: Any) -> None:
    if restart_for(name, body, type) and _stop is not None and not _stop.is_set():
        log.warning("CRD %s was %s: stopping, to start again watching what is there", name,
                    "removed" if _at_start[name] else "installed")
        _stop.set()
