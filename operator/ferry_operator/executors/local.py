"""The local executor: prepare steps as processes on the operator's own host.

Artifacts go to ROOT/<namespace>/<name>/<spec-digest>/artifact (staging beside
it), or, for object-store formats, to storage.s3 (see locations.s3_artifact_uri),
with storage.s3's endpoint and the credentials of its Secret (read through the
API, as the operator's own identity may) in the worker's environment; each step's lock, pid, log and exit code live in
ROOT/<namespace>/<name>/.steps/<step-id>/ so the state survives an operator
restart, and `.steps/<step-id>.launches` counts the workers ever started. Used by `make demo` and the tests,
with a local control plane, so the whole main job runs on one machine.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable

from ..api.types import SECRET_KEYS, Artifact, ModelWeights
from ..planner import MAX_PROGRESS_REPORT_BYTES, ArtifactFacts, StepPhase, StepState
from ..locations import ferry_s3_artifacts, is_ferry_s3_artifact, s3_artifact_uri, s3_compiled_store_uri
from .jobs import MalformedResult, parse_moe_facts, parse_result
from .redact import redact
from ..steps import Step

MANIFEST = "ferry-manifest.json"
PROGRESS_FILE = "progress.json"  # the worker's FERRY_PROGRESS_FILE
# Runs one step's worker: one line in `<step>.launches` per worker started,
# the worker's output in its log, and its exit code in `rc`, renamed into
# place while the step's lock (inherited, and held by the worker too) is still
# held. A shell, not Python: a hundred steps started at once should not pay
# for a hundred interpreters before their workers even begin. Workers run
# niced: they share the host with the operator and the control plane, whose
# latency matters more than a batch copy's (on a cluster they run on other nodes).
RUNNER = """
state=$1; shift
echo $$ >> "$state.launches"
idle=; chrt --idle 0 true 2>/dev/null && idle="chrt --idle 0"  # where the host allows it
$idle "$@" < /dev/null >> "$state/log" 2>&1
rc=$?
echo $rc > "$state/rc.tmp" && mv -f "$state/rc.tmp" "$state/rc"
exit $rc
"""


class LocalExecutor:
    def __init__(self, root: Path, ferry_bin: str):
        self.root = root
        self.ferry_bin = ferry_bin
        # Called with (namespace, name) once a worker this process started has
        # exited, so its ModelWeights is reconciled at once rather than at the next poll.
        self.on_exit: Callable[[str, str], None] | None = None

    def _dir(self, namespace: str, name: str) -> Path:
        return self.root / namespace / name

    def _paths(self, namespace: str, name: str, digest: str) -> dict[str, Path]:
        base = self._dir(namespace, name) / digest
        return {"staging": base / "staging", "artifact": base / "artifact"}

    def _state(self, namespace: str, name: str, step_id: str) -> Path:
        return self._dir(namespace, name) / ".steps" / step_id

    def observe(self, mw: ModelWeights, step: Step) -> StepState:
        state = self._state(mw.metadata.namespace, mw.metadata.name, step.id)
        rc_file = state / "rc"
        if _held(state / "lock"):
            # The runner (or the worker) holds the lock the operator took before
            # launching it: running, whoever started it and whenever.
            return StepState(StepPhase.RUNNING, progress=_progress(state / PROGRESS_FILE))
        if rc_file.exists():
            rc = int(rc_file.read_text())
            if rc == 0:
                return StepState(StepPhase.SUCCEEDED)
            # Exit 2: the worker rejected its input; running it again would not help.
            return StepState(StepPhase.FAILED, _last_error(state / "log", rc), retryable=rc != 2)
        pid_file = state / "pid"
        if not pid_file.exists():
            return StepState(StepPhase.NOT_STARTED)
        if _alive(int(pid_file.read_text())):
            return StepState(StepPhase.RUNNING, progress=_progress(state / PROGRESS_FILE))
        return StepState(StepPhase.FAILED, "worker process exited without recording a status", retryable=True)

    def retry(self, mw: ModelWeights, step: Step) -> None:
        """Forget the failed run: the step is NotStarted again (its outputs stay, so the worker resumes)."""
        shutil.rmtree(self._state(mw.metadata.namespace, mw.metadata.name, step.id), ignore_errors=True)

    def start(self, mw: ModelWeights, uid: str, step: Step) -> None:
        namespace, name = mw.metadata.namespace, mw.metadata.name
        state = self._state(namespace, name, step.id)
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True)
        # Restart safety: the lock is taken before the worker exists and handed
        # to it, so there is no moment at which a worker runs unseen. Killed
        # before the launch, the lock dies with the operator and the step is
        # simply NotStarted again.
        lock = open(state / "lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        paths = self._paths(namespace, name, step.digest)
        # The worker resolves file://, hf:// and s3:// itself; pvc:// only exists in a cluster.
        if mw.spec.source.uri.startswith("pvc://"):
            (state / "log").write_text("pvc:// sources need the kubernetes executor\n")
            (state / "rc").write_text("2")
            lock.close()
            return
        mapping = {"source": mw.spec.source.uri, **{k: str(v) for k, v in paths.items()},
                   "tensorizer_key": str(state / "tensorizer-key")}
        # No cluster credentials: a worker parses untrusted bytes, and reports
        # its progress into a file of its step that the operator copies.
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env.update({"FERRY_RESULT_FILE": str(state / "result.json"),
                    "FERRY_PROGRESS_FILE": str(state / PROGRESS_FILE)})
        s3 = s3_artifact_uri(mw, step.digest)
        if s3 is not None:
            mapping["artifact"] = s3
            if step.name in ("tensorize", "publish"):
                try:
                    env.update(self._storage_env(mw, state))
                except LookupError as exc:
                    (state / "log").write_text(f"{exc}\n")
                    (state / "rc").write_text("1")
                    lock.close()
                    return
        argv = [self.ferry_bin, *(a.format(**mapping) for a in step.argv)]
        (state / "argv.json").write_text(json.dumps(argv))
        with lock:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", RUNNER, "ferry-step", str(state), *argv],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, pass_fds=(lock.fileno(),),
            )
            (state / "pid").write_text(str(proc.pid))
        if self.on_exit is not None:
            threading.Thread(target=self._notify_exit, args=(proc, namespace, name), daemon=True,
                             name=f"worker-{name}").start()

    def _notify_exit(self, proc: subprocess.Popen, namespace: str, name: str) -> None:
        proc.wait()  # also reaps it
        if self.on_exit is not None:
            self.on_exit(namespace, name)

    def _storage_env(self, mw: ModelWeights, state: Path, with_key: bool = True) -> dict[str, str]:
        """storage.s3's endpoint and region, the credentials of its Secret, the tensorizer key as a file."""
        s3 = mw.spec.storage.s3
        env = {"AWS_ENDPOINT_URL": s3.endpoint} if s3.endpoint else {}
        if s3.region:
            env["AWS_DEFAULT_REGION"] = s3.region
        if s3.credentials_secret_ref is not None:
            data = _secret(mw.metadata.namespace, s3.credentials_secret_ref.name)
            env.update({k: data[k] for k in SECRET_KEYS["store"] if k in data})  # by key, never whole
        key = mw.spec.format.tensorizer.encryption_secret_ref if mw.spec.format.tensorizer else None
        if key is not None and with_key:
            value = _secret(mw.metadata.namespace, key.name).get("key")
            if value is None:
                raise LookupError(f"Secret {key.name} has no key `key` (the tensorizer encryption key)")
            path = state / "tensorizer-key"
            path.touch(mode=0o600)
            path.write_text(value)
        return env

    def artifact_uri(self, mw: ModelWeights, last: Step) -> str:
        """Where this executor writes the artifact of the spec `last` ends."""
        local = self._paths(mw.metadata.namespace, mw.metadata.name, last.digest)["artifact"]
        return s3_artifact_uri(mw, last.digest) or f"file://{local}"

    def artifact(self, mw: ModelWeights, last: Step) -> ArtifactFacts | None:
        s3 = s3_artifact_uri(mw, last.digest)
        if s3 is not None:
            # The worker's result: the manifest it published, read back from the store.
            result = self._state(mw.metadata.namespace, mw.metadata.name, last.id) / "result.json"
            try:
                parsed = parse_result(result.read_text())
            except (OSError, MalformedResult):
                return None
            if parsed is None:
                return None
            return ArtifactFacts(uri=s3, total_bytes=parsed.total_bytes, manifest_digest=parsed.manifest_digest,
                                 experts=parsed.experts, expert_parallel=parsed.expert_parallel, target=parsed.target)
        directory = self._paths(mw.metadata.namespace, mw.metadata.name, last.digest)["artifact"]
        manifest = directory / MANIFEST
        if not manifest.is_file():
            return None
        data = manifest.read_bytes()
        body = json.loads(data)
        extra = body.get("extra")
        try:
            # The same facts, checked the same way, as a Job's result carries from this manifest.
            moe = parse_moe_facts(extra if isinstance(extra, dict) else {})
        except MalformedResult:
            return None
        return ArtifactFacts(
            uri=f"file://{directory}",
            total_bytes=int(body["totalBytes"]),
            manifest_digest="sha256:" + hashlib.sha256(data).hexdigest(),
            **moe,
        )

    def finished(self, mw: ModelWeights, steps: list[Step]) -> None:
        """The artifact is recorded: the fetched original its later steps read is dead weight."""
        if len(steps) > 1:
            shutil.rmtree(self._paths(mw.metadata.namespace, mw.metadata.name, steps[-1].digest)["staging"],
                          ignore_errors=True)

    def remove_artifact(self, mw: ModelWeights, uid: str, artifact: Artifact) -> None:
        """A superseded artifact: its directory (staging and artifact) and its steps' records."""
        namespace, name = mw.metadata.namespace, mw.metadata.name
        self._delete_s3(mw, artifact)
        shutil.rmtree(self._dir(namespace, name) / artifact.spec_digest, ignore_errors=True)
        for record in (self._dir(namespace, name) / ".steps").glob(f"*-{artifact.spec_digest}*"):
            if record.is_dir():
                shutil.rmtree(record, ignore_errors=True)
            else:
                record.unlink(missing_ok=True)

    def delete(self, mw: ModelWeights) -> None:
        artifacts = ferry_s3_artifacts(mw)
        for artifact in artifacts:
            self._delete_s3(mw, artifact)
        store = s3_compiled_store_uri(mw)
        if artifacts and store:  # its compiled state beside them
            self._run_s3(mw, ["compiled-delete", "--store", store])
        shutil.rmtree(self._dir(mw.metadata.namespace, mw.metadata.name), ignore_errors=True)

    def _delete_s3(self, mw: ModelWeights, artifact: Artifact) -> None:
        """`ferry delete-artifact` of an S3 artifact Ferry wrote (its own prefix), and only of such."""
        if not is_ferry_s3_artifact(mw, artifact):
            return
        self._run_s3(mw, ["delete-artifact", artifact.uri])

    def _run_s3(self, mw: ModelWeights, argv: list[str]) -> None:
        state = self._dir(mw.metadata.namespace, mw.metadata.name) / ".delete"
        state.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self._storage_env(mw, state, with_key=False)}
        subprocess.run([self.ferry_bin, *argv], env=env, check=True, stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=600)


def _secret(namespace: str, name: str) -> dict[str, str]:
    import base64

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        secret = client.CoreV1Api().read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise LookupError(f"Secret {namespace}/{name} not found: create it with the store's "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
        raise
    return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}


def _progress(path: Path) -> dict | None:
    """The worker's last progress report (untrusted: the planner validates it), if any."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROGRESS_REPORT_BYTES + 1)
        body = json.loads(data) if len(data) <= MAX_PROGRESS_REPORT_BYTES else None
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _held(lock: Path) -> bool:
    """Whether a live process holds the step's lock."""
    try:
        handle = open(lock)
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _last_error(log: Path, rc: int) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()] if log.exists() else []
    # The log tail goes into conditions and Events: credential-looking strings never do.
    return f"exit code {rc}: {redact(lines[-1])[:500]}" if lines else f"exit code {rc}"
