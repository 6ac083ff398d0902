"""One writer per run directory (strategies/checkpoint/run_lock.py): a local directory's lock held by another
process refuses us with the holder named, and is free again the moment that process dies, even by SIGKILL;
object storage (moto's S3 server on 127.0.0.1) gets a renewed lease that a second start is refused while it
is live, and takes over once it has lapsed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import procs
from tests.helpers.s3server import S3Server
from trainforge.strategies.checkpoint import run_lock
from trainforge.strategies.checkpoint.run_lock import LEASE_FILE, LOCK_FILE, acquire_run_lock
from trainforge.strategies.errors import CheckpointError

HOLDER = """
import sys
from trainforge.strategies.checkpoint.run_lock import acquire_run_lock
acquire_run_lock(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""


def start_holder(directory) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=procs.test_env(),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_directory_held_by_another_process_is_refused_naming_it_and_the_holder(tmp_path):
    holder = start_holder(tmp_path / "ckpt")
    try:
        with pytest.raises(CheckpointError) as err:
            acquire_run_lock(tmp_path / "ckpt")
        message = str(err.value)
        assert str(tmp_path / "ckpt") in message
        assert f"pid {holder.pid}" in message and socket.gethostname() in message
        assert "started 20" in message and "Wait until that process ends" in message
    finally:
        holder.communicate("\n", timeout=30)
    # the holder ended normally: its lock file is gone and the directory free again
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
    acquire_run_lock(tmp_path / "ckpt").release()


def test_a_killed_holder_leaves_the_lock_free(tmp_path):
    holder = start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    lock = acquire_run_lock(tmp_path)
    note = json.loads((tmp_path / LOCK_FILE).read_text())
    assert note["pid"] == os.getpid()
    lock.release()


def test_the_lock_is_reentrant_within_a_process_and_released_by_its_last_holder(tmp_path):
    first = acquire_run_lock(tmp_path)
    second = acquire_run_lock(tmp_path)
    assert first is second
    first.release()
    probe = subprocess.run(
        [sys.executable, "-c", HOLDER, str(tmp_path)], input="\n", capture_output=True, text=True, env=procs.test_env()
    )
    assert probe.returncode != 0 and "is in use by another process" in probe.stderr
    second.release()
    second.release()  # a release too many is a no-op
    probe = subprocess.run(
        [sys.executable, "-c", HOLDER, str(tmp_path)], input="\n", capture_output=True, text=True, env=procs.test_env()
    )
    assert probe.returncode == 0, probe.stderr


@pytest.fixture(scope="module")
def s3():
    s3fs = pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    # fsspec keeps filesystems by their arguments: one made for another module's server would be reused
    s3fs.S3FileSystem.clear_instance_cache()
    server = S3Server()
    try:
        with server.environ():
            yield server
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def write_lease(s3, url: str, lease) -> None:
    with s3.fs().open(url.split("://", 1)[1] + "/" + LEASE_FILE, "wb") as f:
        f.write(lease if isinstance(lease, bytes) else json.dumps(lease).encode())


def test_a_live_lease_in_object_storage_is_refused_and_a_lapsed_one_taken_over(s3, monkeypatch):
    monkeypatch.setattr(run_lock, "SETTLE_SECONDS", 0.05)
    url = f"s3://{s3.bucket()}/run/checkpoints"
    other = {"owner": "someone-else", "host": "node7", "pid": 4242, "started": "2026-11-28T06:00:00+00:00"}
    write_lease(s3, url, {**other, "expires": time.time() + 600})
    with pytest.raises(CheckpointError) as err:
        acquire_run_lock(url)
    assert url in str(err.value) and "host node7, pid 4242" in str(err.value) and "lapses" in str(err.value)
    write_lease(s3, url, {**other, "expires": time.time() - 1})
    lock = acquire_run_lock(url)
    with s3.fs().open(url.split("://", 1)[1] + "/" + LEASE_FILE, "rb") as f:
        assert json.loads(f.read())["pid"] == os.getpid()
    lock.release()
    assert not s3.fs().exists(url.split("://", 1)[1] + "/" + LEASE_FILE)


def test_the_holder_renews_its_lease_so_it_outlives_its_first_expiry(s3, monkeypatch):
    monkeypatch.setattr(run_lock, "SETTLE_SECONDS", 0.05)
    monkeypatch.setattr(run_lock, "LEASE_SECONDS", 1.5)
    url = f"s3://{s3.bucket()}/run"
    lock = acquire_run_lock(url)
    try:
        time.sleep(3.5)
        with s3.fs().open(url.split("://", 1)[1] + "/" + LEASE_FILE, "rb") as f:
            assert json.loads(f.read())["expires"] > time.time()
    finally:
        lock.release()


def test_an_unreadable_lease_object_is_not_a_live_holder(s3, monkeypatch):
    monkeypatch.setattr(run_lock, "SETTLE_SECONDS", 0.05)
    url = f"s3://{s3.bucket()}/run"
    for junk in (b"not json", b"[1, 2]", json.dumps({"owner": "x", "expires": "soon"}).encode()):
        write_lease(s3, url, junk)
        acquire_run_lock(url).release()


def test_a_lock_file_holding_no_readable_note_still_refuses(tmp_path):
    holder = start_holder(tmp_path)
    try:
        # the note is for people; the lock is the flock, whatever the file says
        (tmp_path / LOCK_FILE).write_text("not json")
        with pytest.raises(CheckpointError, match=r"in use by another process writing the same run \(host \?, pid \?"):
            acquire_run_lock(tmp_path)
    finally:
        holder.communicate("\n", timeout=30)


def test_a_fit_on_a_bucket_whose_run_is_leased_stops_before_writing(s3, monkeypatch, tmp_path):
    from torch.utils.data import DataLoader

    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer

    monkeypatch.setattr(run_lock, "SETTLE_SECONDS", 0.05)
    monkeypatch.chdir(tmp_path)
    bucket = s3.bucket()
    url = f"s3://{bucket}/run/checkpoints"
    write_lease(s3, url, {"owner": "x", "host": "node3", "pid": 77, "started": "then", "expires": time.time() + 600})
    trainer = Trainer(default_root_dir=f"s3://{bucket}/run", max_steps=2, enable_progress_bar=False)
    with pytest.raises(CheckpointError, match=r"s3://.*/run/checkpoints is in use .*host node3, pid 77"):
        trainer.fit(Regressor(make_net()), DataLoader(regression_data(16), batch_size=8))
    assert s3.fs().ls(f"{bucket}/run/checkpoints") == [f"{bucket}/run/checkpoints/{LEASE_FILE}"]
