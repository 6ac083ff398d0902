"""Checkpoints in object storage (strategies/checkpoint/remote.py) against a real S3 API: moto's server on
127.0.0.1 (tests/helpers/s3server.py), read and written through s3fs, never the internet.

Visible only when complete (manifest, then ``latest``, last), verified on load with fallback to the newest
valid one, pruning only what trainforge wrote, bit-identical resume on 1 and 2 processes (asynchronous upload
on 2), and bad URLs refused before training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from tests.helpers import forklaunch, procs
from tests.helpers.s3server import S3Server
from trainforge.strategies.checkpoint.remote import MARKER, RemotePath, cache_dir, is_remote
from trainforge.strategies.checkpoint.remote_read import (
    delete_checkpoint_at,
    list_remote,
    read_remote_latest,
    resolve_remote,
)
from trainforge.strategies.checkpoint.remote_write import RemoteCheckpointWriter
from trainforge.strategies.errors import CheckpointError, ConfigurationError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "remote_run.py"


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1 for this module, stopped at its end."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3Server()
    try:
        with server.environ():
            yield server
    finally:
        server.stop()


def save(url: str, step: int, value: float = 1.0) -> RemotePath:
    writer = RemoteCheckpointWriter(url, kind="trainer")
    writer.save_tensors("model", {"w": torch.full((4,), value)})
    writer.save_object("trainer_state", {"step": step})
    return writer.finalize({"step": step, "kind": "trainer"})


def test_a_checkpoint_appears_with_its_manifest_and_latest_moves_last(s3, tmp_path):
    bucket = s3.bucket()
    fs = s3.fs()
    root = f"s3://{bucket}/run/checkpoints"
    path = save(f"{root}/step-2", 2)
    assert path == RemotePath(f"{root}/step-2") and is_remote(path) and not is_remote(str(tmp_path))
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/run/checkpoints/step-2"))
    assert names == ["metadata.json", "model.safetensors", "trainer_state.pt"]  # the marker is gone
    assert read_remote_latest(RemotePath(root)) == "step-2"
    manifest = json.loads(fs.cat(f"{bucket}/run/checkpoints/step-2/metadata.json"))
    assert sorted(manifest["files"]) == ["model.safetensors", "trainer_state.pt"]
    local, url = resolve_remote(RemotePath(root), "last", tmp_path / "cache")
    assert url == path and load_file(local / "model.safetensors")["w"].tolist() == [1.0] * 4


def test_half_uploaded_and_corrupted_checkpoints_are_skipped_with_fallback(s3, tmp_path):
    bucket = s3.bucket()
    fs = s3.fs()
    root = RemotePath(f"s3://{bucket}/run/checkpoints")
    save(f"{root}/step-2", 2, 2.0)
    save(f"{root}/step-4", 4, 4.0)
    # an upload killed before its manifest: files and our marker, no metadata.json -> never listed
    fs.pipe(f"{bucket}/run/checkpoints/step-6/{MARKER}", b"x")
    fs.pipe(f"{bucket}/run/checkpoints/step-6/model.safetensors", b"half")
    assert [p.name for p, _ in list_remote(root)] == ["step-2", "step-4"]
    # bit rot in the newest complete one, which latest names: skipped with the reason, step-2 is loaded
    data = bytearray(fs.cat(f"{bucket}/run/checkpoints/step-4/model.safetensors"))
    data[-1] ^= 0xFF
    fs.pipe(f"{bucket}/run/checkpoints/step-4/model.safetensors", bytes(data))
    with pytest.warns(UserWarning, match=r"(?s)step-4.*checksum mismatch"):
        local, url = resolve_remote(root, "last", tmp_path / "cache")
    assert url is not None and url.name == "step-2"
    assert load_file(local / "model.safetensors")["w"].tolist() == [2.0] * 4
    with pytest.raises(CheckpointError, match="checksum mismatch"):  # named explicitly: no substitution
        resolve_remote(root, "step-4", tmp_path / "cache")
    # a killed upload of ours is replaced by the next save of that name
    save(f"{root}/step-6", 6, 6.0)
    assert [p.name for p, _ in list_remote(root)] == ["step-2", "step-4", "step-6"]


def test_pruning_deletes_only_complete_checkpoints_trainforge_wrote(s3):
    bucket = s3.bucket()
    fs = s3.fs()
    root = RemotePath(f"s3://{bucket}/run/checkpoints")
    fs.pipe(f"{bucket}/run/checkpoints/notes.txt", b"mine")
    fs.pipe(f"{bucket}/run/checkpoints/mine/data.bin", b"mine")
    old = save(f"{root}/step-2", 2)
    fs.pipe(f"{bucket}/run/checkpoints/step-2/README.md", b"a user's note inside a checkpoint's folder")
    save(f"{root}/step-4", 4)
    assert delete_checkpoint_at(str(old), root)
    left = set(fs.find(f"{bucket}/run"))
    assert f"{bucket}/run/checkpoints/step-2/README.md" in left  # not in the manifest: not ours
    assert not any(p.startswith(f"{bucket}/run/checkpoints/step-2/") and "README" not in p for p in left)
    assert {f"{bucket}/run/checkpoints/notes.txt", f"{bucket}/run/checkpoints/mine/data.bin"} <= left
    with pytest.raises(CheckpointError, match="not a trainforge checkpoint"):
        delete_checkpoint_at(f"{root}/mine", root)
    with pytest.raises(CheckpointError, match="not inside"):
        delete_checkpoint_at(f"s3://{bucket}/elsewhere/step-4", root)
    with pytest.warns(UserWarning, match="resume point"):
        assert not delete_checkpoint_at(f"{root}/step-4", root)  # latest names it
    with pytest.raises(ConfigurationError, match="not a trainforge checkpoint"):
        save(f"{root}/mine", 8)  # a user's folder is never replaced


def run(tmp: Path, s3, url: str, out: str, *args: str, nproc: int = 0) -> dict:
    forklaunch.launch(
        str(SCRIPT), "--root", url, "--out", str(tmp / out), *args,
        nproc=nproc, timeout=180, env=procs.test_env(**s3.env), cwd=tmp,
    )  # fmt: skip
    return json.loads((tmp / f"{out}.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(s3, tmp_path_factory):
    """``uninterrupted(nproc, strategy)``: the final weights of the run of 8 steps without a stop, what a stopped
    and resumed run must end on. Checkpointed to local disk (where it saves does not change what it trains), and
    run once per training for the module: DDP with each rank described as alone on its node trains the same."""
    done: dict = {}

    def weights(nproc: int, strategy: str) -> Path:
        if (nproc, strategy) not in done:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{strategy}")
            extra = ("--strategy", strategy, "--async-save") if nproc else ()
            full = run(tmp, s3, str(tmp / "run"), "full.st", "--max-steps", "8", *extra, nproc=nproc)
            assert full["final_step"] == 8
            done[nproc, strategy] = tmp / "full.st"
        return done[nproc, strategy]

    return weights


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"final weights differ at {key}"


@pytest.mark.slow
@pytest.mark.parametrize("nproc,strategy", [(0, "auto"), (2, "ddp"), (2, "fsdp"), (2, "ddp-2-nodes")])
def test_a_run_stopped_and_resumed_from_s3_ends_bit_identical(s3, uninterrupted, tmp_path, nproc, strategy):
    """1 process synchronous; 2 processes with the upload in the background (DDP, FSDP2's DCP shards, and DDP
    with each rank described as alone on its node: two staging dirs, each node uploading its own files)."""
    bucket = s3.bucket()
    extra = ("--strategy", strategy.split("-")[0], "--async-save") if nproc else ()
    if strategy.endswith("nodes"):
        extra += ("--one-per-node",)
    # user objects under the run's prefix: pruning (keep_last_k=1) never touches them
    fs = s3.fs()
    fs.pipe(f"{bucket}/cut/checkpoints/notes.txt", b"mine")
    fs.pipe(f"{bucket}/cut/checkpoints/mine/model.safetensors", b"mine")
    run(tmp_path, s3, f"s3://{bucket}/cut", "first.st", "--max-steps", "4", "--keep", "1", *extra, nproc=nproc)
    ours = sorted(p for p in fs.find(f"{bucket}/cut/checkpoints") if p.endswith("metadata.json"))
    assert ours == [f"{bucket}/cut/checkpoints/epoch=0-step=4/metadata.json"]  # step 2 pruned after step 4 committed
    manifest = json.loads(fs.cat(ours[0]))["files"]
    assert {f"rng_rank{r}.pt" for r in range(max(nproc, 1))} <= set(manifest)  # every rank's files, uploaded
    if strategy == "fsdp":  # each rank's DCP shard
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest)
    assert all(fs.size(f"{bucket}/cut/checkpoints/epoch=0-step=4/{rel}") == e["size"] for rel, e in manifest.items())
    resumed = run(tmp_path, s3, f"s3://{bucket}/cut", "cut.st", "--max-steps", "8", "--resume", *extra, nproc=nproc)
    assert resumed["final_step"] == 8
    root = RemotePath(f"s3://{bucket}/cut/checkpoints")  # downloaded once per node, read by its ranks
    assert cache_dir(root, "node0").is_dir() and cache_dir(root, "node1").is_dir() == strategy.endswith("nodes")
    assert_same_weights(uninterrupted(nproc, strategy.split("-")[0]), tmp_path / "cut.st")
    assert fs.cat(f"{bucket}/cut/checkpoints/latest").endswith(b"-step=8\n")
    assert fs.cat(f"{bucket}/cut/checkpoints/notes.txt") == b"mine"
    assert fs.cat(f"{bucket}/cut/checkpoints/mine/model.safetensors") == b"mine"
    assert not (tmp_path / "s3:").exists()  # no local folder named after the URL


def test_bad_urls_are_refused_before_training(s3, tmp_path, monkeypatch):
    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer
    from trainforge.callbacks import ModelCheckpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=r"nosuchproto://b/run.*install"):
        Trainer(default_root_dir="nosuchproto://b/run", max_steps=2)
    with pytest.raises(ConfigurationError, match=r"nosuchproto://b/ck.*install"):
        ModelCheckpoint(dirpath="nosuchproto://b/ck")
    with pytest.raises(ConfigurationError, match=r"'s3:/b/run' looks like a URL.*'s3://b/run'"):
        Trainer(default_root_dir=Path("s3://b/run"), max_steps=2)
    with pytest.raises(ConfigurationError, match=r"'s3:/b/ck' looks like a URL"):
        ModelCheckpoint(dirpath=Path("s3://b/ck"))
    module = Regressor(make_net())
    trainer = Trainer(default_root_dir="s3://no-such-bucket-here/run", max_steps=2, enable_progress_bar=False)
    loader = torch.utils.data.DataLoader(regression_data(16), batch_size=8)
    with pytest.raises(ConfigurationError, match=r"s3://no-such-bucket-here/run/checkpoints.*bucket exists"):
        trainer.fit(module, loader)
    assert trainer.global_step == 0 and not module.losses  # nothing trained
    assert not (tmp_path / "s3:").exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-n", "0"]))


def test_accelerator_save_state_and_load_state_round_trip_through_s3(s3, tmp_path):
    from tests.helpers.models import make_net, regression_data
    from trainforge import Accelerator

    bucket = s3.bucket()
    acc = Accelerator(seed=0)
    net = make_net(dropout=0.2)
    model, opt, dl = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), DataLoader(regression_data(32)))
    for x, y in dl:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    url = f"s3://{bucket}/acc/step-32"
    saved = acc.save_state(url)
    assert str(saved) == url and s3.fs().exists(f"{bucket}/acc/step-32/metadata.json")
    assert not s3.fs().exists(f"{bucket}/acc/latest")  # save_state(dir) names its directory, as locally
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    after_save = torch.rand(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(url)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert torch.equal(torch.rand(3), after_save)  # the RNG streams continue from the save


def test_a_server_dying_mid_upload_leaves_the_previous_checkpoint_the_one_latest_names(s3, tmp_path, monkeypatch):
    import s3fs
    from moto.server import ThreadedMotoServer

    bucket = s3.bucket()
    root = RemotePath(f"s3://{bucket}/run/checkpoints")
    save(f"{root}/step-2", 2, 2.0)
    host, port = s3._server.get_host_and_port()
    original = s3fs.S3FileSystem._put_file
    calls = []

    async def put_then_die(self, *args, **kwargs):  # the first file arrives, then the server is gone
        calls.append(args)
        if len(calls) == 1:
            await original(self, *args, **kwargs)
            s3._server.stop()
            return None
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", put_then_die)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries of a dead endpoint ...
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # ... and botocore's, read by a client made from here on
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(CheckpointError, match=rf"upload of {root}/step-4 failed.*still names the previous one"):
            save(f"{root}/step-4", 4, 4.0)
    finally:
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()
        s3._server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)  # the same in-memory store
        s3._server.start()
    assert read_remote_latest(root) == "step-2"
    assert [p.name for p, _ in list_remote(root)] == ["step-2"]  # step-4 has files but no manifest
    local, url = resolve_remote(root, "last", tmp_path / "cache")
    assert url is not None and url.name == "step-2"
    assert load_file(local / "model.safetensors")["w"].tolist() == [2.0] * 4


def test_no_manifest_unless_every_node_listed_its_files_and_every_file_is_in_the_store(s3, tmp_path):
    from trainforge.strategies.checkpoint.io import CheckpointWriter
    from trainforge.strategies.checkpoint.remote_write import commit, prepare_prefix, upload_node

    bucket = s3.bucket()
    dest = RemotePath(f"s3://{bucket}/run/step-1")
    prepare_prefix(dest, None, "test")
    writer = CheckpointWriter(tmp_path / "node0" / "step-1")
    writer.save_object("rng_rank0", {"a": 1})
    upload_node(writer.finalize({"step": 1}), dest, 0)
    with pytest.raises(CheckpointError, match="node 1 uploaded no file list"):  # node 1 failed or died
        commit(dest, nodes=2, world_size=2, update_latest=True)
    assert list_remote(dest.parent) == [] and read_remote_latest(dest.parent) is None
    s3.fs().rm_file(f"{bucket}/run/step-1/rng_rank0.pt")  # an upload that did not arrive
    with pytest.raises(CheckpointError, match=r"rng_rank0.pt: missing in the store"):
        commit(dest, nodes=1, world_size=1, update_latest=True)
    assert list_remote(dest.parent) == [] and read_remote_latest(dest.parent) is None


def test_load_from_checkpoint_validate_and_accelerator_project_dir_with_urls(s3, tmp_path, monkeypatch):
    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Accelerator, Trainer

    monkeypatch.chdir(tmp_path)
    bucket = s3.bucket()
    module = Regressor(make_net())
    trainer = Trainer(default_root_dir=f"s3://{bucket}/run", max_steps=2, enable_progress_bar=False)
    trainer.fit(module, DataLoader(regression_data(16), batch_size=8))
    assert trainer.default_checkpoint_dir == f"s3://{bucket}/run/checkpoints"
    assert Path(trainer.default_root_dir) == tmp_path / "runs"  # logs stay local, under the local default
    url = f"s3://{bucket}/run/checkpoints/" + read_remote_latest(RemotePath(trainer.default_checkpoint_dir))
    loaded = Regressor.load_from_checkpoint(url, net=make_net())
    for key, value in module.net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[key], value), key
    trainer.validate(module, DataLoader(regression_data(16), batch_size=8), ckpt_path="last")
    with pytest.raises(ConfigurationError, match=r"project_dir='s3://.*local directory.*save_state"):
        Accelerator(project_dir=f"s3://{bucket}/acc", automatic_checkpoint_naming=True)
    assert not (tmp_path / "s3:").exists()


def test_a_killed_upload_keeps_its_name_free_and_other_objects_take_it(s3):
    from trainforge.strategies.checkpoint.remote_read import remote_name_taken

    bucket = s3.bucket()
    fs = s3.fs()
    root = RemotePath(f"s3://{bucket}/run/checkpoints")
    fs.pipe(f"{bucket}/run/checkpoints/killed/{MARKER}", b"x")
    fs.pipe(f"{bucket}/run/checkpoints/killed/rng_rank0.pt", b"half")
    fs.pipe(f"{bucket}/run/checkpoints/yours/data.bin", b"mine")
    writer = RemoteCheckpointWriter(f"{root}/ours", kind="trainer")
    writer.save_object("trainer_state", {"step": 1})
    writer.finalize({"step": 1, "kind": "trainer", "run_id": "run-a"})
    assert not remote_name_taken(root / "killed", "run-a")  # our killed upload: the resumed run saves there
    assert not remote_name_taken(root / "free", "run-a")
    assert remote_name_taken(root / "yours", "run-a")  # not a checkpoint: ModelCheckpoint saves as yours-v1
    assert not remote_name_taken(root / "ours", "run-a") and remote_name_taken(root / "ours", "run-b")


def test_missing_credentials_are_an_error_naming_the_url_before_training(s3, tmp_path, monkeypatch):
    import s3fs

    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer

    monkeypatch.chdir(tmp_path)
    bucket = s3.bucket()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(key, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # a filesystem made earlier holds the credentials it found
    try:
        module = Regressor(make_net())
        trainer = Trainer(default_root_dir=f"s3://{bucket}/run", max_steps=2, resume="auto", enable_progress_bar=False)
        with pytest.raises(
            ConfigurationError, match=rf"s3://{bucket}/run/checkpoints.*NoCredentialsError.*credentials"
        ):
            trainer.fit(module, DataLoader(regression_data(16), batch_size=8))
        assert trainer.global_step == 0 and not module.losses
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_file_url_that_cannot_be_written_gets_local_advice_not_a_buckets(tmp_path):
    from trainforge.strategies.checkpoint.remote_read import check_writable_at

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made under a file, whoever runs the test (root too)
    with pytest.raises(ConfigurationError) as refused:
        check_writable_at(f"file://{blocker}/dir", "ModelCheckpoint(dirpath)", "Pass dirpath=")
    message = str(refused.value)
    assert f"cannot write to file://{blocker}/dir" in message and "file:// is a local path" in message
    assert "bucket" not in message and "credentials" not in message  # was: advice about buckets and AWS keys


def test_an_unreachable_endpoint_is_an_error_naming_the_url_before_training(tmp_path, monkeypatch):
    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer
    from trainforge.strategies.environment import find_free_port

    pytest.importorskip("s3fs")
    import s3fs

    monkeypatch.chdir(tmp_path)
    for key, value in S3Server.dummy_env(f"http://127.0.0.1:{find_free_port()}").items():  # nothing listens there
        monkeypatch.setenv(key, value)
    # botocore's own setting (AWS_MAX_ATTEMPTS, read when s3fs makes its client): one try, where its default
    # retries a refused connection with backoff for ~10 s before raising the same EndpointConnectionError
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        module = Regressor(make_net())
        trainer = Trainer(default_root_dir="s3://bucket/run", max_steps=2, enable_progress_bar=False)
        with pytest.raises(ConfigurationError, match=r"s3://bucket/run/checkpoints.*EndpointConnectionError.*endpoint"):
            trainer.fit(module, DataLoader(regression_data(16), batch_size=8))
        assert trainer.global_step == 0 and not module.losses
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


EXIT_RIGHT_AFTER_SAVE = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.helpers.models import make_net
from trainforge import Accelerator
acc = Accelerator(seed=0)
net = make_net()
model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters()))
acc.save_state({url!r}, async_save=True)  # returns once staged; the upload runs in the background
print("returned", flush=True)
"""


@pytest.mark.slow
def test_a_process_ending_right_after_an_asynchronous_save_commits_the_upload_first(s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/acc/checkpoint_0"
    script = tmp_path / "exit_after_save.py"
    script.write_text(EXIT_RIGHT_AFTER_SAVE.format(repo=str(ROOT), url=url))
    # the script's whole interpreter exit (teardown=True): threading's exit hooks, atexit, module teardown
    out = forklaunch.run_script(script, timeout=120, cwd=tmp_path, env=procs.test_env(**s3.env), teardown=True).stdout
    assert "returned" in out
    local, found = resolve_remote(RemotePath(url).parent, url, tmp_path / "cache")  # complete and verified
    assert found == RemotePath(url) and (local / "model.safetensors").is_file()


@pytest.mark.slow
def test_megatron_tensor_parallel_shards_go_to_s3_and_resume_exactly(s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/tp/step-3"
    script = ROOT / "tests" / "scripts" / "remote_megatron.py"
    forklaunch.launch(str(script), url, str(tmp_path / "out.json"), nproc=2, timeout=240, env=procs.test_env(**s3.env))
    assert json.loads((tmp_path / "out.json").read_text()) == {"losses_equal": True, "weights_equal": True}
    manifest = json.loads(s3.fs().cat(f"{bucket}/tp/step-3/metadata.json"))["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= set(manifest)  # both ranks' shards


def test_loss_spike_rollback_restores_the_newest_checkpoint_from_s3(s3, tmp_path, monkeypatch):
    """LossSpikes(rollback_after=2) with checkpoints in the bucket ends on the weights of the same run on disk."""
    import copy
    import math

    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer, seed_everything
    from trainforge.callbacks import LossSpikes, ModelCheckpoint

    monkeypatch.chdir(tmp_path)
    x, y = regression_data(n=64).tensors
    x = x.clone()
    x[5 * 8 + 1] = x[6 * 8 + 1] = math.nan  # batches 5 and 6 spike: back to the checkpoint of step 4
    seed_everything(0)
    net = make_net()
    results = []
    for root in (str(tmp_path / "disk"), f"s3://{s3.bucket()}/run"):
        spikes = LossSpikes(threshold=10.0, window=2, rollback_after=2)
        module = Regressor(copy.deepcopy(net), step_lr=True)
        trainer = Trainer(
            default_root_dir=root, max_epochs=1, enable_progress_bar=False,
            callbacks=[spikes, ModelCheckpoint(every_n_steps=2)],
        )  # fmt: skip
        trainer.fit(module, DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
        assert spikes.rollbacks == 1
        results.append(module.net.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
