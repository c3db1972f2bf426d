"""The node agent's CSI driver over real gRPC on its unix sockets, with real
bind mounts (root), as the kubelet calls it: a fill pod's slot adopted only
after the agent's own verification, entries shared read-only, a flipped byte
refused with the file named, a symlink planted by a fill pod never followed,
a manifest a fill pod wrote naming a host file refused by name (issue 29),
one fill per entry, a full cache refused with the reason, and a restarted
agent finishing what ended while it was down. The kubelet itself and the
Pod Security side are proven on the real node (tests/node/test_node_cache_on_node.py)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from file_damage import flip_byte
from ferry_worker.cache.csi import mounts
from ferry_worker.cache.csi.agent import sockets, start
from ferry_worker.cache.csi.proto import csi_pb2, csi_pb2_grpc
from ferry_worker.cache.csi.proto import pluginregistration_pb2 as reg_pb2, pluginregistration_pb2_grpc as reg_grpc
from ferry_worker.cache.fill_slot import fill_slot
from ferry_worker.cache.store import CacheStore, Watermarks, cache_key
from ferry_worker.manifest import MANIFEST_NAME, manifest_digest, read_manifest

BIG = Watermarks(high=1 << 40, low=1 << 39)


@pytest.fixture(scope="module")
def artifacts(cache_artifacts) -> dict[str, Path]:
    return cache_artifacts


class Agent:
    """An agent on a temporary kubelet directory, and the kubelet's side of its calls."""

    def __init__(self, tmp: Path, marks: Watermarks = BIG, mount_wait: float = 0.5):
        # A socket path has at most 107 characters: the kubelet directory gets a short one of its own.
        self.kubelet = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
        self.cache, self.marks, self.mount_wait = tmp / "cache", marks, mount_wait
        self.targets: list[Path] = []
        self.start()

    def start(self) -> None:
        self.store = CacheStore(self.cache, self.marks)
        self.server = start(self.store, self.kubelet, "node-a", self.mount_wait)
        csi_sock, reg_sock = sockets(self.kubelet)
        self.channel = grpc.insecure_channel(f"unix://{csi_sock}")
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.registration = reg_grpc.RegistrationStub(grpc.insecure_channel(f"unix://{reg_sock}"))

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=None).wait()

    def publish(self, pod: str, attrs: dict) -> Path:
        target = self.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / "weights" / "mount"
        self.targets.append(target)
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=f"csi-{pod}", target_path=str(target), readonly=attrs.get("mode", "serve") == "serve",
            volume_context={**attrs, "csi.storage.k8s.io/ephemeral": "true",
                            "csi.storage.k8s.io/pod.name": pod, "csi.storage.k8s.io/pod.namespace": "team-a"}))
        return target

    def unpublish(self, pod: str) -> None:
        target = self.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / "weights" / "mount"
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=f"csi-{pod}",
                                                                         target_path=str(target)))

    def fill(self, pod: str, source: Path, ranks: str = "") -> Path:
        """A fill pod's life: the slot mounted, `ferry cache fill-slot` run in it, the pod gone."""
        slot = self.publish(pod, fill_attrs(source, ranks))
        fill_slot(slot, source, manifest_digest(source), [int(r) for r in ranks.split(",")] if ranks else None)
        self.unpublish(pod)
        return slot

    def cleanup(self) -> None:
        for target in self.targets:
            if mounts.is_mount(target):
                mounts.unmount(target)
        self.stop()
        shutil.rmtree(self.kubelet, ignore_errors=True)


@pytest.fixture
def agent(tmp_path):
    a = Agent(tmp_path)
    yield a
    a.cleanup()


def fill_attrs(source: Path, ranks: str = "") -> dict:
    size = sum(e.size for e in read_manifest(source).files)
    return {"digest": manifest_digest(source), "mode": "fill", "bytes": str(size), **({"ranks": ranks} if ranks else {})}


def serve_attrs(source: Path, ranks: str = "") -> dict:
    return {"digest": manifest_digest(source), **({"ranks": ranks} if ranks else {})}


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_registration_and_identity_answer_as_the_kubelet_expects(agent):
    info = agent.registration.GetInfo(reg_pb2.InfoRequest())
    assert (info.type, info.name, info.endpoint) == ("CSIPlugin", "cache.ferry.dev", str(sockets(agent.kubelet)[0]))
    assert "1.0.0" in info.supported_versions
    agent.registration.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True))
    assert agent.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest()).name == "cache.ferry.dev"
    assert agent.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == "node-a"


def test_a_fill_pods_slot_is_published_once_verified_and_shared_read_only(agent, artifacts):
    source = artifacts["a0"]
    key = cache_key(manifest_digest(source), [1])
    # Before any fill, a serving mount waits mount_wait, then is refused for the kubelet to retry.
    assert refused(lambda: agent.publish("early", serve_attrs(source, "1"))).code() == grpc.StatusCode.UNAVAILABLE
    agent.fill("filler", source, ranks="1")
    entry = agent.store.entry(key)
    assert entry is not None and {p.name for p in entry.iterdir()} >= {"model-rank-1-part-0.safetensors", MANIFEST_NAME}
    assert "model-rank-0-part-0.safetensors" not in {p.name for p in entry.iterdir()}
    inode = entry.stat().st_ino
    a, b = agent.publish("pod-a", serve_attrs(source, "1")), agent.publish("pod-b", serve_attrs(source, "1"))
    assert (a / "model-rank-1-part-0.safetensors").read_bytes() == (source / "model-rank-1-part-0.safetensors").read_bytes()
    with pytest.raises(OSError) as info:
        (b / "extra").write_text("x")
    assert info.value.errno == errno.EROFS
    assert agent.store.holders(key) == ["csi-pod-a", "csi-pod-b"]
    assert agent.store.evict(needed=1 << 41) == []  # mounted: never evicted
    agent.unpublish("pod-a")
    agent.unpublish("pod-b")
    assert agent.store.holders(key) == [] and not a.exists()
    assert agent.store.entry(key).stat().st_ino == inode  # one entry, not filled again


def test_a_flipped_byte_is_refused_naming_the_file_and_refilled(agent, artifacts):
    source = artifacts["a0"]
    key = cache_key(manifest_digest(source))
    agent.fill("filler", source)
    victim = agent.store.entry(key) / "model-rank-1-part-0.safetensors"
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    error = refused(lambda: agent.publish("pod-a", serve_attrs(source)))
    assert error.code() == grpc.StatusCode.DATA_LOSS and "model-rank-1-part-0.safetensors" in error.details()
    assert agent.store.entry(key) is None  # removed: the next fill fetches it again
    agent.fill("filler-2", source)
    agent.publish("pod-a", serve_attrs(source))
    agent.unpublish("pod-a")


def test_a_fill_pod_cannot_lead_the_agent_to_a_host_file(agent, artifacts, tmp_path):
    """A symlink planted in the slot is removed, never followed (no chown, no chmod, no read of its
    target); the rest is adopted only if it verifies."""
    source = artifacts["a1"]
    secret = tmp_path / "host-secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    os.chown(secret, 1234, 1234)
    slot = agent.publish("filler", fill_attrs(source))
    fill_slot(slot, source, manifest_digest(source), None)
    (slot / "planted").symlink_to(secret)
    agent.unpublish("filler")
    entry = agent.store.entry(cache_key(manifest_digest(source)))
    assert entry is not None and not (entry / "planted").exists() and not (entry / "planted").is_symlink()
    st = secret.stat()
    assert (st.st_uid, st.st_mode & 0o777, secret.read_text()) == (1234, 0o600, "root only")
    assert all(p.stat().st_uid == 0 and not p.stat().st_mode & 0o222 for p in entry.iterdir())


def test_a_fill_pods_manifest_cannot_lead_the_agent_out_of_its_slot(agent, artifacts, tmp_path, caplog):
    """The measured attack (issue 29): a fill pod asks for the digest of a manifest it writes itself, one
    whose entry names a host file `..` up from the slot; adopting the slot unlinked that file. Now the
    manifest is refused by name (manifest.py: hostile input), the slot removed, the host file intact."""
    host_file = tmp_path / "host-file"
    host_file.write_bytes(b"c" * 7777)
    body = json.loads((artifacts["a0"] / MANIFEST_NAME).read_bytes())
    body["files"].append({"path": "../../../host-file", "size": 1, "sha256": "0" * 64})
    data = json.dumps(body).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    slot = agent.publish("tenant-filler", {"digest": digest, "mode": "fill", "bytes": "100"})
    (slot / MANIFEST_NAME).write_bytes(data)
    agent.unpublish("tenant-filler")
    assert host_file.read_bytes() == b"c" * 7777
    key = cache_key(digest)
    assert agent.store.entry(key) is None and not (agent.cache / "filling" / key).exists()
    assert "entry '../../../host-file': path segment '..'" in caplog.text and "7777" not in caplog.text


def test_excess_bytes_and_junk_are_not_adopted(agent, artifacts):
    source = artifacts["a0"]
    key = cache_key(manifest_digest(source))
    slot = agent.publish("stuffer", fill_attrs(source))
    fill_slot(slot, source, manifest_digest(source), None)
    (slot / "padding").write_bytes(b"\0" * (2 << 20))  # more than the declared bytes
    agent.unpublish("stuffer")
    assert agent.store.entry(key) is None and not (agent.cache / "filling" / key).exists()
    slot = agent.publish("junk", fill_attrs(source))
    (slot / MANIFEST_NAME).write_text('{"not": "the manifest of this digest"}')
    (slot / "model-rank-0-part-0.safetensors").write_bytes(b"junk")
    agent.unpublish("junk")
    assert agent.store.entry(key) is None and not (agent.cache / "filling" / key).exists()


def test_one_fill_per_entry_and_an_unfinished_fill_resumes(agent, artifacts):
    source = artifacts["a1"]
    key = cache_key(manifest_digest(source))
    slot = agent.publish("first", fill_attrs(source))
    error = refused(lambda: agent.publish("second", fill_attrs(source)))
    assert error.code() == grpc.StatusCode.ABORTED and "one fill per entry" in error.details()
    # The first fill pod dies after one file: nothing is published, the verified file is kept.
    files = sorted(read_manifest(source).files, key=lambda e: e.path)
    done = next(e for e in files if e.path.endswith(".safetensors"))
    fill_slot_one(slot, source, done)
    agent.unpublish("first")
    assert agent.store.entry(key) is None
    kept = agent.cache / "filling" / key / done.path
    assert kept.exists() and kept.stat().st_uid == 0
    inode = kept.stat().st_ino
    agent.fill("second", source)
    assert agent.store.entry(key) is not None
    assert (agent.store.entry(key) / done.path).stat().st_ino == inode  # kept, not copied again


def fill_slot_one(slot: Path, source: Path, entry) -> None:
    from ferry_worker.cache.store import copy_into

    manifest_bytes = (source / MANIFEST_NAME).read_bytes()
    copy_into(slot, source, manifest_bytes, [entry])
    (slot / MANIFEST_NAME).rename(slot / ".ferry-manifest.pending.json")  # killed before the last step


def test_a_full_cache_refuses_the_fill_with_the_reason(tmp_path, artifacts):
    size = sum(e.size for e in read_manifest(artifacts["a0"]).files)
    agent = Agent(tmp_path, Watermarks(high=int(1.5 * size), low=size))
    try:
        agent.fill("filler", artifacts["a0"])
        agent.publish("pod-a", serve_attrs(artifacts["a0"]))
        error = refused(lambda: agent.publish("filler-2", fill_attrs(artifacts["a1"])))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "high watermark" in error.details() and "node-a" in error.details()
    finally:
        agent.cleanup()


def test_a_restarted_agent_adopts_the_fill_that_ended_while_it_was_down(agent, artifacts):
    source = artifacts["a0"]
    key = cache_key(manifest_digest(source))
    slot = agent.publish("filler", fill_attrs(source))
    fill_slot(slot, source, manifest_digest(source), None)
    agent.stop()  # the agent dies; the pod ends and its mount goes without it
    mounts.unmount(slot)
    agent.start()
    assert agent.store.entry(key) is not None
    assert not list((agent.cache / "volumes").glob("*.json"))
    agent.publish("pod-a", serve_attrs(source))
    agent.stop()  # a mounted volume survives a restart, still held
    agent.start()
    assert agent.store.holders(key) == ["csi-pod-a"]
    agent.unpublish("pod-a")
    assert agent.store.holders(key) == []


def test_bytes_past_a_files_size_are_never_published_or_served(agent, artifacts):
    """The readers read only the manifest's size of each file: a longer file is refused on its length."""
    source = artifacts["a1"]
    key = cache_key(manifest_digest(source))
    slot = agent.publish("padder", fill_attrs(source))
    fill_slot(slot, source, manifest_digest(source), None)
    victim = slot / "model-rank-0-part-0.safetensors"
    victim.chmod(0o644)
    with open(victim, "ab") as f:
        f.write(b"appended")
    agent.unpublish("padder")
    assert agent.store.entry(key) is None  # not adopted; the padded file is gone, the rest kept for a resume
    assert not (agent.cache / "filling" / key / "model-rank-0-part-0.safetensors").exists()
    agent.fill("refiller", source)
    entry = agent.store.entry(key)
    victim = entry / "model-rank-0-part-0.safetensors"
    victim.chmod(0o644)
    with open(victim, "ab") as f:
        f.write(b"appended")
    error = refused(lambda: agent.publish("pod-a", serve_attrs(source)))
    assert error.code() == grpc.StatusCode.DATA_LOSS and "model-rank-0-part-0.safetensors" in error.details()


def test_room_made_for_a_fill_is_kept_for_it(tmp_path, artifacts):
    """Two fill slots that each fit alone do not both get the same room: the first one's declared bytes
    count until it is adopted. And a fill that could not fit even with every entry gone evicts nothing."""
    size = sum(e.size for e in read_manifest(artifacts["a0"]).files)
    agent = Agent(tmp_path, Watermarks(high=int(1.5 * size), low=size))
    try:
        agent.fill("filler", artifacts["a2"])
        kept = cache_key(manifest_digest(artifacts["a2"]))
        agent.publish("first", fill_attrs(artifacts["a0"]))  # a2 (unmounted) is evicted to make its room
        assert agent.store.entry(kept) is None
        error = refused(lambda: agent.publish("second", fill_attrs(artifacts["a1"])))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # nothing written yet, but the room is taken
        agent.unpublish("first")  # ended with nothing in its slot: dropped, its room given back
        agent.fill("third", artifacts["a1"])
        huge = {**fill_attrs(artifacts["a0"]), "bytes": str(100 * size)}
        error = refused(lambda: agent.publish("greedy", huge))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert agent.store.entry(cache_key(manifest_digest(artifacts["a1"]))) is not None  # not evicted for it
    finally:
        agent.cleanup()


def test_an_entry_found_corrupt_under_a_pod_is_refused_to_new_mounts_and_fills_until_it_goes(agent, artifacts):
    source = artifacts["a1"]
    key = cache_key(manifest_digest(source))
    agent.fill("filler", source)
    agent.publish("serving", serve_attrs(source))
    entry = agent.store.entry(key)
    victim = flip_byte(sorted(entry.glob("*.safetensors"))[0], 0)
    with pytest.raises(Exception, match=victim.name):
        agent.store.check(key)  # the scrub, or an admin's `ferry cache check`
    # Neither a new serving pod nor a fill pod gets it (a fill would find the corrupt entry "complete").
    for pod, attrs in (("second", serve_attrs(source)), ("refill", fill_attrs(source))):
        error = refused(lambda: agent.publish(pod, attrs))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "found corrupt and is still mounted by 1 pod: " in \
            error.details(), error.details()
    agent.unpublish("serving")  # its pod goes: so does the entry, and a fill can start
    assert agent.store.entry(key) is None
    agent.fill("refill", source)
    assert agent.store.entry(key) is not None and not agent.store.corrupt()
