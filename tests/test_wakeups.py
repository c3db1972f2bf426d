"""Wake-ups without a cluster: who wakes which reconciler, and the sleep that
ends on a wake, a stop, or the timeout."""
from __future__ import annotations

import asyncio
import threading

from ferry_operator.wakeups import Wakeups, sleep


class Stopped:
    """kopf's DaemonStopped, as far as `sleep` uses it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def test_a_deployment_wakes_only_the_objects_that_wire_it() -> None:
    async def scenario() -> None:
        w = Wakeups()
        a, b = w.register(("ml", "a")), w.register(("ml", "b"))
        w.record(("ml", "a"), (1, None, None), ["vllm"])
        w.record(("ml", "b"), (1, None, None), ["other"])
        w.wake_wirers(("ml", "vllm"))
        assert a.is_set() and not b.is_set()
        w.wake_wirers(("other-namespace", "other"))
        assert not b.is_set()
        # Rewired elsewhere: the old Deployment no longer wakes it.
        a.clear()
        w.record(("ml", "a"), (2, None, None), ["new"])
        w.wake_wirers(("ml", "vllm"))
        assert not a.is_set()

    asyncio.run(scenario())


def test_only_a_change_of_the_inputs_counts_as_a_change() -> None:
    w = Wakeups()
    assert w.inputs_changed(("ml", "a"), (1, None, None))  # never reconciled
    w.record(("ml", "a"), (1, None, None), [])
    assert not w.inputs_changed(("ml", "a"), (1, None, None))  # its own status write echoed back
    assert w.inputs_changed(("ml", "a"), (1, "1764000000", None))  # the retry annotation
    assert w.inputs_changed(("ml", "a"), (2, None, None))  # a spec change


def test_sleep_ends_on_a_wake_from_another_thread_a_stop_or_the_timeout() -> None:
    async def scenario() -> None:
        w = Wakeups()
        wake, stopped = w.register(("ml", "a")), Stopped()
        loop = asyncio.get_running_loop()

        threading.Timer(0.05, w.wake_threadsafe, args=("ml", "a")).start()
        started = loop.time()
        await sleep(wake, stopped, 30)
        assert wake.is_set() and loop.time() - started < 30

        wake.clear()
        loop.call_later(0.05, stopped.event.set)
        await sleep(wake, stopped, 30)
        assert stopped and not wake.is_set()

        await sleep(w.register(("ml", "b")), Stopped(), 0.01)  # neither: the timeout ends it

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_unregistered_object_is_forgotten() -> None:
    async def scenario() -> None:
        w = Wakeups()
        event = w.register(("ml", "a"))
        w.record(("ml", "a"), (1, None, None), ["vllm"])
        w.unregister(("ml", "a"), event)
        w.wake(("ml", "a"))
        w.wake_wirers(("ml", "vllm"))
        assert not event.is_set()
        assert w.inputs_changed(("ml", "a"), (1, None, None))

    asyncio.run(scenario())


def test_a_node_cache_label_wakes_only_the_objects_that_count_it() -> None:
    async def scenario() -> None:
        w = Wakeups()
        a, b = w.register(("ml", "a")), w.register(("ml", "b"))
        w.reads_labels(("ml", "a"), frozenset({"cache.ferry.dev/aaa", "cache.ferry.dev/evicted.aaa"}))
        w.reads_labels(("ml", "b"), frozenset({"cache.ferry.dev/bbb"}))
        w.wake_label_readers({"cache.ferry.dev/evicted.aaa", "cache.ferry.dev/ccc"})
        assert a.is_set() and not b.is_set()
        # A new artifact: its old label no longer wakes it; unregistered, nothing does.
        a.clear()
        w.reads_labels(("ml", "a"), frozenset({"cache.ferry.dev/ddd"}))
        w.wake_label_readers({"cache.ferry.dev/aaa"})
        assert not a.is_set()
        w.unregister(("ml", "b"), b)
        w.wake_label_readers({"cache.ferry.dev/bbb"})
        assert not b.is_set() and w._label_readers == {"cache.ferry.dev/ddd": {("ml", "a")}}

    asyncio.run(scenario())
