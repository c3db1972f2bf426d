"""The local executor: prepare steps as processes on the operator's own host.

Artifacts go to ROOT/<namespace>/<name>/<spec-digest>/artifact (staging beside
it); each step's lock, pid, log and exit code live in
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
import sys
from pathlib import Path

from ..api.types import Artifact, ModelWeights
from ..planner import ArtifactFacts, StepPhase, StepState
from ..steps import Step

MANIFEST = "ferry-manifest.json"


class LocalExecutor:
    def __init__(self, root: Path, ferry_bin: str, kubeconfig: str | None = None):
        self.root = root
        self.ferry_bin = ferry_bin
        self.kubeconfig = kubeconfig

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
            return StepState(StepPhase.RUNNING)
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
            return StepState(StepPhase.RUNNING)
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
        mapping = {"source": mw.spec.source.uri, **{k: str(v) for k, v in paths.items()}}
        argv = [self.ferry_bin, *(a.format(**mapping) for a in step.argv)]
        env = {**os.environ, "FERRY_MODELWEIGHTS_NAME": name, "FERRY_MODELWEIGHTS_NAMESPACE": namespace}
        if self.kubeconfig:
            env["KUBECONFIG"] = self.kubeconfig
        (state / "argv.json").write_text(json.dumps(argv))
        with lock:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ferry_operator.executors.local_runner", str(state),
                 "--lock-fd", str(lock.fileno()), "--", *argv],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, pass_fds=(lock.fileno(),),
            )
            (state / "pid").write_text(str(proc.pid))

    def artifact(self, mw: ModelWeights, last: Step) -> ArtifactFacts | None:
        directory = self._paths(mw.metadata.namespace, mw.metadata.name, last.digest)["artifact"]
        manifest = directory / MANIFEST
        if not manifest.is_file():
            return None
        data = manifest.read_bytes()
        body = json.loads(data)
        return ArtifactFacts(
            uri=f"file://{directory}",
            total_bytes=int(body["totalBytes"]),
            manifest_digest="sha256:" + hashlib.sha256(data).hexdigest(),
        )

    def remove_artifact(self, mw: ModelWeights, uid: str, artifact: Artifact) -> None:
        """A superseded artifact: its directory (staging and artifact) and its steps' records."""
        namespace, name = mw.metadata.namespace, mw.metadata.name
        shutil.rmtree(self._dir(namespace, name) / artifact.spec_digest, ignore_errors=True)
        for record in (self._dir(namespace, name) / ".steps").glob(f"*-{artifact.spec_digest}*"):
            if record.is_dir():
                shutil.rmtree(record, ignore_errors=True)
            else:
                record.unlink(missing_ok=True)

    def delete(self, mw: ModelWeights) -> None:
        shutil.rmtree(self._dir(mw.metadata.namespace, mw.metadata.name), ignore_errors=True)


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
    return f"exit code {rc}: {lines[-1][:500]}" if lines else f"exit code {rc}"
