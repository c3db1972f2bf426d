"""A namespaced operator does not scan the cluster, and restarts once for a CRD that appears later.

kopf follows namespaces and CRDs as they come and go by listing and watching them. A namespaced install may
not list namespaces (charts/ferry/templates/rbac.yaml: nothing cluster-wide beyond a few reads), and kopf 1.45
retries a forbidden request 9 times (1+1+2+3+5+8+13+21 s) before it falls back to the names it was given: the
operator reconciled nothing for the first 54 s of every start (install, upgrade, eviction). With exact
namespace names there is nothing to follow, so `ferry-operator run --namespace=...` turns kopf's scanning off
(`settings.scanning.disabled`, kopf's documented restricted mode): it watches the namespaces as given from the
first second, and never asks for namespaces (tests/node/conftest.py reads the audit log for that).

What scanning off costs: a CRD installed after the start is not watched until the next start. Of the kinds
Ferry watches, a cluster may install one later: LeaderWorkerSet's. So the operator records at startup which
of them were missing, and when one is established it stops, and its Deployment starts it again, now watching
it. Watching all namespaces, kopf follows CRDs itself and nothing here acts.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import kopf

from .indexes import LWS

log = logging.getLogger("ferry_operator")
# The CRDs of the kinds Ferry watches that a cluster may lack (it is told how to read them at startup).
OPTIONAL_CRDS = frozenset({f"{LWS.plural}.{LWS.group}"})
# Set to stop the operator (`kopf.run(stop_flag=...)`): the pod's restart makes kopf watch the new kind.
STOP = threading.Event()
_missing_at_start: set[str] = set()


def established(crd: Mapping[str, Any] | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def note_missing(read_crd) -> set[str]:
    """At startup, with scanning off: which optional CRDs are not established, so not watched. `read_crd(name)`
    returns the CRD as a dict, or None when it does not exist."""
    _missing_at_start.clear()
    _missing_at_start.update(name for name in OPTIONAL_CRDS if not established(read_crd(name)))
    for name in sorted(_missing_at_start):
        log.warning("CRD %s is not installed: its kind is not watched. Once it is, the operator restarts to "
                    "watch it (a namespaced operator does not follow CRDs)", name)
    return set(_missing_at_start)


def restart_for(name: str, crd: Mapping[str, Any]) -> bool:
    """Whether this CRD event asks for a restart: a CRD that was missing at startup is now established."""
    return name in _missing_at_start and established(crd)


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions",
               when=lambda name, **_: name in OPTIONAL_CRDS)
async def optional_crd_changed(name: str, body: kopf.Body, **_: Any) -> None:
    if restart_for(name, body):
        log.warning("CRD %s is now established: stopping, so that the operator starts again watching it", name)
        STOP.set()
