"""TensorBoardLogger: event files of a real fit read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.callbacks.test_trackers_base import Recorder, StandIn, fit
from trainforge.callbacks.trackers import TensorBoardLogger
from trainforge.callbacks.trackers.base import flatten_params

if TYPE_CHECKING:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.fixture(scope="module", autouse=True)
def needs_tensorboard():
    """Imported here, not at the top: collection would import TensorBoard's readers in every worker."""
    return pytest.importorskip("tensorboard")


def load(directory) -> EventAccumulator:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_fit_writes_scalars_and_hparams(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    recorder, logger = Recorder(), TensorBoardLogger()
    trainer = fit([recorder, logger], tmp_path, log_every=2)
    assert logger.directory == logger.log_dir == str(tmp_path / "lightning_logs" / "version_0")
    acc = load(logger.directory)
    assert scalars(acc, "hp_metric") == [(0, -1.0)]  # Lightning's default_hp_metric
    assert (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text() == "lr: 0.05\nwidth: 4\n"
    for tag in ("train/loss", "val/loss"):
        expected = recorder.history(tag)
        assert [s for s, _ in scalars(acc, tag)] == [s for s, _ in expected] != []
        assert [v for _, v in scalars(acc, tag)] == pytest.approx([v for _, v in expected], rel=1e-6)  # float32
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content)
    logged = start.session_start_info.hparams
    expected = flatten_params(trainer.hparams)
    assert set(logged) == set(expected) and "lr" in expected
    for key, value in expected.items():
        if isinstance(value, (bool, int, float)):
            assert logged[key].number_value == pytest.approx(float(value)), key
        else:
            assert logged[key].string_value == str(value), key
    table = acc.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| lr | 0.05 |" in table and "| trainer/max_epochs | 2 |" in table


def test_a_new_run_gets_its_own_version_and_resume_purges_the_replayed_steps(tmp_path):
    first = TensorBoardLogger()
    trainer = StandIn(tmp_path)
    first.on_fit_start(trainer, None)
    for step in range(1, 7):
        first.on_log(trainer, None, {"loss": float(step)}, step)
    state = first.state_dict()
    first.on_exception(trainer, None, RuntimeError("crash after step 6"))

    resumed = TensorBoardLogger()
    resumed.load_state_dict(state)
    # fit(ckpt_path="last") / resume="auto": the Trainer settles the logger on the newest version
    resumed.settle(str(tmp_path), lambda value, src: value, continuing=True)
    resumed.on_fit_start(StandIn(tmp_path, step=4), None)  # the checkpoint of step 4
    for step in range(5, 8):
        resumed.on_log(trainer, None, {"loss": step * 10.0}, step)
    resumed.on_fit_end(trainer, None)
    assert resumed.directory == first.directory
    # TensorBoard drops the crashed run's events after step 4 and shows the resumed ones.
    assert scalars(load(first.directory), "loss") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 50.0),
        (6, 60.0),
        (7, 70.0),
    ]
    fresh = TensorBoardLogger()
    fresh.on_fit_start(trainer, None)
    fresh.on_fit_end(trainer, None)
    assert fresh.directory == str(tmp_path / "lightning_logs" / "version_1")
