"""S3 faults during `ferry tensorize`: 5xx answers, slow answers, the server
stopped mid-upload. Each ends in retries, then either success or one clear
error line; a partial upload never gets a manifest, and a rerun succeeds."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from fault_proxy import PASS, FaultProxy
from s3server import S3Server
from checkpoints import write_checkpoint
from tensorize_support import LLAMA_MID, checkpoint_tensors, deserialize, list_keys, run_ferry

pytestmark = pytest.mark.tensorize

PENDING = ".ferry-pending.json"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "llama-mid"
    write_checkpoint(directory, LLAMA_MID, seed=5)
    return directory


def _tensorize(checkpoint: Path, uri: str, env: dict, *extra: str):
    return run_ferry("tensorize", "--source", str(checkpoint), "--output", uri, "--part-size", "5Mi",
                     "--concurrency", "2", *extra, env=env)


def _assert_unpublished(client, bucket: str, prefix: str) -> None:
    """Nothing complete: no manifest, no tensor object; only the record of what the run meant to write."""
    assert list_keys(client, bucket, prefix) == [PENDING]


def _assert_published(s3_server, bucket: str, prefix: str, checkpoint: Path, env: dict) -> None:
    assert "ferry-manifest.json" in list_keys(s3_server.client(), bucket, prefix)
    assert PENDING not in list_keys(s3_server.client(), bucket, prefix)
    assert run_ferry("verify", f"s3://{bucket}/{prefix}", env=env).returncode == 0
    assert deserialize(f"s3://{bucket}/{prefix}/model.tensors", s3_server) == checkpoint_tensors(checkpoint)


def test_transient_5xx_are_retried(s3_server, bucket, checkpoint):
    def rule(seen):  # the second and third part uploads fail once each
        return ("status", 503) if seen.is_upload_part and seen.upload_parts_before in (1, 2) else PASS

    with FaultProxy(s3_server.endpoint, rule) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        proc = _tensorize(checkpoint, f"s3://{bucket}/flaky", env)
        assert proc.returncode == 0, proc.stderr
        assert proxy.upload_parts() >= 9  # 7 parts + 2 retried
    _assert_published(s3_server, bucket, "flaky", checkpoint, s3_server.env())


def test_persistent_5xx_fail_clearly_and_a_rerun_succeeds(s3_server, bucket, checkpoint, tmp_path):
    def rule(seen):  # every part after the first: 500
        return ("status", 500) if seen.is_upload_part and seen.upload_parts_before >= 1 else PASS

    result = tmp_path / "result"
    with FaultProxy(s3_server.endpoint, rule) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "FERRY_RESULT_FILE": str(result)}
        proc = _tensorize(checkpoint, f"s3://{bucket}/broken", env, "--attempts", "3")
        assert proc.returncode == 1, proc.stderr
        aborted = [s for s in proxy.seen if s.method == "DELETE" and "uploadId=" in s.path]
    line = result.read_text()
    assert line.startswith("tensorize failed: s3://") and "model.tensors: uploading part" in line
    assert "InternalError" in line and "reached max retries: 2" in line
    assert aborted, "the multipart upload was not aborted"
    client = s3_server.client()
    _assert_unpublished(client, bucket, "broken")
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    proc = _tensorize(checkpoint, f"s3://{bucket}/broken", s3_server.env())
    assert proc.returncode == 0, proc.stderr
    _assert_published(s3_server, bucket, "broken", checkpoint, s3_server.env())


def test_slow_answers_time_out_then_fail_clearly(s3_server, bucket, checkpoint, tmp_path):
    def rule(seen):
        return ("delay", 3.0) if seen.is_upload_part else PASS

    with FaultProxy(s3_server.endpoint, rule) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        started = time.monotonic()
        proc = _tensorize(checkpoint, f"s3://{bucket}/slow", env, "--timeout", "1", "--attempts", "2")
        elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert "Read timeout" in proc.stderr and "uploading part" in proc.stderr
    assert elapsed < 60
    _assert_unpublished(s3_server.client(), bucket, "slow")


def test_server_stopped_mid_upload_then_a_rerun_succeeds(tmp_path, checkpoint):
    server = S3Server(tmp_path / "s3")
    server.start()
    try:
        server.client().create_bucket(Bucket="stopped")

        def rule(seen):  # the third part upload finds the server gone
            return ("kill", server.stop) if seen.is_upload_part and seen.upload_parts_before == 2 else PASS

        with FaultProxy(server.endpoint, rule) as proxy:
            env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
            proc = _tensorize(checkpoint, "s3://stopped/m", env, "--attempts", "3")
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("ferry: tensorize failed: s3://stopped/m/model.tensors: ")
        assert "Could not connect" in last or "Connection was closed" in last, last
        server.start()  # same data directory, new port: what the upload left is all there is
        _assert_unpublished(server.client(), "stopped", "m")
        proc = _tensorize(checkpoint, "s3://stopped/m", server.env())
        assert proc.returncode == 0, proc.stderr
        _assert_published(server, "stopped", "m", checkpoint, server.env())
    finally:
        server.stop()
