"""The Accelerator is built from parts it composes (process control, collectives, data preparation, the
item-weighted loss window, trackers, profiling), not from mixins that re-declare its attributes: each part gets
what it uses as arguments and reads nothing of the Accelerator (docs/ARCHITECTURE.md, "The loop and its events")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.helpers.ast_rules import type_checking_blocks_in_classes
from trainforge import Accelerator
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.collectives import Collectives
from trainforge.trainer.accelerator.process_control import ProcessControl
from trainforge.trainer.accelerator.token_loss import ItemWindow
from trainforge.trainer.accelerator.wrappers import GradientState
from trainforge.trainer.compat.accelerate.state import PartialState

REPO = Path(__file__).resolve().parents[2]
PARTS = [
    *sorted((REPO / "trainer" / "accelerator").glob("*.py")),
    REPO / "trainer" / "compat" / "accelerate" / "accelerator_args.py",
    REPO / "trainer" / "compat" / "accelerate" / "state.py",
    REPO / "trainer" / "compat" / "accelerate" / "trackers.py",
    REPO / "trainer" / "inference" / "api.py",
    REPO / "trainer" / "loop" / "profiling.py",
]


def test_the_accelerator_mixes_in_nothing():
    assert Accelerator.__bases__ == (object,)


def test_partial_state_is_a_process_control_over_a_strategy_of_its_own():
    assert PartialState.__bases__ == (ProcessControl,)
    state = PartialState(cpu=True)
    assert state.strategy is not Accelerator(cpu=True).strategy


def test_no_part_redeclares_its_host_under_type_checking():
    offenders = []
    for path in PARTS:
        offenders += [f"{path.name}:{where}" for where in type_checking_blocks_in_classes(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_check_bites():
    tree = ast.parse("class Part:\n    if TYPE_CHECKING:\n        strategy: int\n")
    assert type_checking_blocks_in_classes(tree) == ["Part:2"]


def test_the_parts_work_from_the_inputs_they_are_given():
    """Built without an Accelerator, from a strategy and a gradient state alone."""
    strategy = Accelerator(cpu=True).strategy
    state = GradientState()
    collectives = Collectives(strategy, state)
    assert torch.equal(collectives.gather(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert int(collectives.reduce(torch.tensor(3))) == 3
    window = ItemWindow(strategy)
    loss = window.loss_to_backward(torch.tensor(6.0), None, accumulation_steps=3)
    assert float(loss) == 2.0 and window.count is None
    window.loss_to_backward(torch.tensor(6.0), 4, accumulation_steps=3)
    assert window.state_dict() == {"items_in_window": 4}
    with pytest.raises(ConfigurationError, match="backward without num_items inside an accumulation window"):
        window.loss_to_backward(torch.tensor(1.0), None, accumulation_steps=3)


def test_the_accelerator_delegates_with_accelerate_signatures():
    """The public names stay where Accelerate users call them, with the values their parts hold."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    with acc.main_process_first(), acc.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    assert acc.on_process(lambda: "ran", process_index=0)() == "ran"
    assert acc.gather_object({"a": 1}) == [{"a": 1}]
    assert acc.trackers == [] and acc.log_with == [] and acc.items_in_window is None
    assert float(acc.loss_to_backward(torch.tensor(4.0), None)) == 2.0
    with acc.init_empty_weights():
        built = torch.nn.Linear(2, 2)
    assert built.weight.device.type == "meta"


def test_an_accelerator_and_its_loaders_are_freed_without_the_garbage_collector():
    """No part holds the Accelerator (a bound method of it would make a cycle): dropped, it is freed at once,
    and so are its prepared loaders, whose persistent DataLoader workers then end at once instead of at a
    later collection or at exit (where their shutdown waited 5 s per worker)."""
    import gc
    import weakref

    from torch.utils.data import DataLoader, TensorDataset

    gc.collect()
    gc.disable()
    try:
        acc = Accelerator()
        model = torch.nn.Linear(2, 1)
        model, opt, loader = acc.prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2),
        )
        next(iter(loader))
        refs = [weakref.ref(acc), weakref.ref(loader)]
        del acc, model, opt, loader
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()
