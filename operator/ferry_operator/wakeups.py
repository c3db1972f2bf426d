"""Which ModelWeights to reconcile now, and when to look again.

Each ModelWeights has one reconciler (a kopf daemon) that sleeps until woken
or until its resync is due. It is woken by the watch events of what it
depends on — its own spec or retry annotation, its prepare Jobs and their
pods, the Deployments it wires and their pods, the node cache labels of its
artifact — and by a local worker's exit. So a change is acted on as it happens, and an idle object costs a
wake-up per resync, not a re-plan every couple of seconds.

Everything here runs on the operator's event loop except `wake_threadsafe`
and `record`, which the reconcile threads call.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Hashable

Key = tuple[str, str]  # (namespace, name)


class Wakeups:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[Key, asyncio.Event] = {}
        self._lock = threading.Lock()  # guards the maps below (written by reconcile threads)
        self._wirers: dict[Key, set[Key]] = {}  # Deployment -> the ModelWeights that wire it
        self._wires: dict[Key, set[Key]] = {}  # ModelWeights -> the Deployments it wires
        self._inputs: dict[Key, Hashable] = {}  # ModelWeights -> the inputs it was last reconciled with
        self._label_readers: dict[str, set[Key]] = {}  # node label -> the ModelWeights whose status counts it
        self._labels_read: dict[Key, frozenset[str]] = {}

    def register(self, key: Key) -> asyncio.Event:
        """The reconciler's wake-up flag (called on the loop, as the reconciler starts)."""
        self._loop = asyncio.get_running_loop()
        event = self._events[key] = asyncio.Event()
        return event

    def unregister(self, key: Key, event: asyncio.Event) -> None:
        if self._events.get(key) is event:
            del self._events[key]
        with self._lock:
            self._inputs.pop(key, None)
            released = self._rewire(key, set())
            self._read_labels(key, frozenset())
        self._wake_soon(released)

    def wake(self, key: Key) -> None:
        event = self._events.get(key)
        if event is not None:
            event.set()

    def wake_threadsafe(self, namespace: str, name: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.wake, (namespace, name))

    def record(self, key: Key, inputs: Hashable, deployments: list[str]) -> None:
        """What a reconcile just saw: its own inputs, and the Deployments it wires."""
        with self._lock:
            self._inputs[key] = inputs
            released = self._rewire(key, {(key[0], name) for name in deployments})
        self._wake_soon(released)

    def _wake_soon(self, keys: set[Key]) -> None:
        """Thread-safe: from the loop or a reconcile thread."""
        if keys and self._loop is not None and not self._loop.is_closed():
            for key in keys:
                self._loop.call_soon_threadsafe(self.wake, key)

    def _rewire(self, key: Key, deployments: set[Key]) -> set[Key]:
        """Under the lock: `key` now wires exactly `deployments` (one reconcile's cost stays
        proportional to its own Deployments, not to every object's). Returns the other
        ModelWeights still naming a Deployment `key` let go: one may own it now."""
        old = self._wires.pop(key, set())
        released: set[Key] = set()
        for deployment in old - deployments:
            owners = self._wirers[deployment]
            owners.discard(key)
            released |= owners
            if not owners:
                del self._wirers[deployment]
        for deployment in deployments - old:
            self._wirers.setdefault(deployment, set()).add(key)
        if deployments:
            self._wires[key] = deployments
        return released

    def inputs_changed(self, key: Key, inputs: Hashable) -> bool:
        with self._lock:
            return self._inputs.get(key) != inputs

    def reads_labels(self, key: Key, labels: frozenset[str]) -> None:
        """`key`'s status counts the nodes carrying these labels (its artifact's node cache labels)."""
        with self._lock:
            self._read_labels(key, labels)

    def _read_labels(self, key: Key, labels: frozenset[str]) -> None:
        for label in self._labels_read.pop(key, frozenset()) - labels:
            readers = self._label_readers[label]
            readers.discard(key)
            if not readers:
                del self._label_readers[label]
        for label in labels:
            self._label_readers.setdefault(label, set()).add(key)
        if labels:
            self._labels_read[key] = labels

    def wake_label_readers(self, labels: set[str]) -> None:
        """A node's labels changed: wake those that count nodes by them."""
        with self._lock:
            keys = {key for label in labels for key in self._label_readers.get(label, ())}
        for key in keys:
            self.wake(key)

    def wake_wirers(self, deployment: Key) -> None:
        with self._lock:
            owners = list(self._wirers.get(deployment, ()))
        for key in owners:
            self.wake(key)


async def sleep(wake: asyncio.Event, stopped: Any, timeout: float) -> None:
    """Until woken, stopped (kopf's flag, awaitable), or `timeout` seconds pass."""
    if wake.is_set() or stopped:
        return

    async def until_stopped() -> None:
        await stopped.wait()

    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(until_stopped())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
