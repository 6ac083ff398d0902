"""Per-rank memory of (pp, dp, tp) layouts and the choice MegatronStrategy's "auto" sizes make
(strategies/parallel/layout.py), and `trainforge estimate-memory --layouts`."""

import pytest
import torch

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.memory_estimate import bytes_per_param
from trainforge.strategies.parallel.layout import (
    LayoutRow,
    ModelShape,
    choose_layout,
    estimate_layouts,
    layer_activation_bytes,
    measure_activation_bytes,
)
from trainforge.trainer.cli import main as cli

SHAPE = ModelShape(params=1_000_000_000, layers=24, hidden=2048, heads=16)


def _rows(world, **kw):
    return {(r.pp, r.dp, r.tp): r for r in estimate_layouts(SHAPE, world, seq_len=2048, **kw)}


def test_every_layout_multiplies_to_the_world_and_splits_states_over_all_ranks():
    rows = _rows(8)
    assert set(rows) == {(pp, 8 // (pp * tp), tp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if pp * tp <= 8}
    per_param = sum(bytes_per_param("bf16-mixed", "adam"))
    for row in rows.values():  # FSDP2 on dp shards what tp x pp leave: every rank holds 1/world of the states
        assert row.states == -(-SHAPE.params * per_param // 8)


def test_tensor_parallel_shares_activations_as_megatron_and_sequence_parallel_splits_them_all():
    rows, sp = _rows(8), _rows(8, sequence_parallel=True)
    one = rows[(1, 8, 1)].activations
    assert rows[(1, 4, 2)].activations == pytest.approx(one * (10 + 24 / 2) / 34, rel=1e-6)
    assert sp[(1, 4, 2)].activations == pytest.approx(one / 2, rel=1e-6)
    assert sp[(1, 1, 8)].activations < rows[(1, 1, 8)].activations


def test_pipeline_memory_follows_the_schedule():
    onef1b, gpipe = _rows(8), _rows(8, schedule="gpipe", num_microbatches=16)
    one = onef1b[(1, 8, 1)].activations
    assert onef1b[(4, 2, 1)].activations == pytest.approx(one, rel=1e-6)  # p micro-batches of L/p layers
    assert gpipe[(4, 2, 1)].activations == pytest.approx(one * 16 / 4, rel=1e-6)  # every micro-batch in flight


def test_activation_checkpointing_keeps_layer_inputs_and_one_layer():
    full, ckpt = _rows(8)[(1, 8, 1)], _rows(8, activation_checkpointing=True)[(1, 8, 1)]
    inputs = SHAPE.layers * 2048 * SHAPE.hidden * 2
    assert ckpt.activations == pytest.approx(inputs + full.activations / SHAPE.layers, rel=1e-6)


def test_tensor_parallel_stays_in_a_node_and_splits_whole_heads():
    rows = estimate_layouts(ModelShape(10**9, 24, 1536, 12), 16, seq_len=512, ranks_per_node=4)
    assert {r.tp for r in rows} == {1, 2, 4}  # 8 and 16 exceed a node of 4; 12 heads split by 1, 2, 4
    assert max(r.pp for r in rows) == 16 and estimate_layouts(ModelShape(10**9, 2, 64, 4), 8, seq_len=8)[-1].pp == 2


def test_choose_takes_the_fewest_model_parallel_ranks_that_fit_and_errors_with_the_table():
    rows = estimate_layouts(SHAPE, 8, seq_len=2048, micro_batch_size=4)
    assert [(r.tp * r.pp) for r in rows] == sorted(r.tp * r.pp for r in rows)
    budget = rows[1].total / 0.75 + 1  # the second row just fits with 25% kept free; the first does not
    assert rows[0].total > rows[1].total
    assert choose_layout(rows, int(budget)) == rows[1]
    table = r"(?s)no \(pp, dp, tp\) layout fits .*pp=1 x dp=8 x tp=1.*activation_checkpointing=True"
    with pytest.raises(ConfigurationError, match=table):
        choose_layout(rows, 10**6)


def test_formula_counts_attention_scores_only_for_eager_attention():
    fused = layer_activation_bytes(SHAPE, 1024, 1, "bf16-mixed")
    assert fused == 1024 * SHAPE.hidden * 34
    assert (
        layer_activation_bytes(SHAPE, 1024, 1, "bf16-mixed", eager_attention=True)
        == fused + 5 * SHAPE.heads * 1024 * 1024
    )
    assert layer_activation_bytes(SHAPE, 1024, 1, "32") == 2 * fused


def _saved_bytes_on_cpu(model, ids):
    kept = {}

    def pack(t):
        base = t._base if t._base is not None else t
        kept.setdefault(id(base), base)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return sum(t.numel() * t.element_size() for t in kept.values())


def test_meta_measurement_equals_what_autograd_saves_on_the_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=64, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    real = _saved_bytes_on_cpu(model, torch.randint(0, 96, (2, 32)))
    assert measure_activation_bytes(model, 32, 2, "32", eager_attention=True) == real
    scores = 2 * 2 * 4 * 32 * 32 * 4  # per layer: softmax output and its dropout's result, fp32
    assert measure_activation_bytes(model, 32, 2, "32") <= real - scores
    assert next(model.parameters()).device.type == "cpu"  # measured on a meta copy


def test_shape_of_a_model_without_a_config_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="ModelShape\\(params=..., layers=..., hidden=..., heads=...\\)"):
        ModelShape.of(torch.nn.Linear(2, 2), 6)
    with pytest.raises(ConfigurationError, match="no config.vocab_size"):
        measure_activation_bytes(torch.nn.Linear(2, 2), 8, 1)
    with pytest.raises(ConfigurationError, match="seq_len=0 must be an int >= 1"):
        estimate_layouts(SHAPE, 8, seq_len=0)
    assert LayoutRow(2, 2, 2, 1, 2).name == "pp=2 x dp=2 x tp=2"


def test_cli_layouts_for_a_transformers_model(capsys):
    pytest.importorskip("transformers")
    assert (
        cli.main(
            [
                "estimate-memory",
                "gpt2",
                "--layouts",
                "--seq-len",
                "1024",
                "--num-processes",
                "4",
                "--device-memory",
                "6GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "activations of one micro-batch measured on the meta device" in out
    assert "pp=1 x dp=4 x tp=1" in out and "pp=1 x dp=1 x tp=4" in out and "<- chosen" in out
    assert "choice: MegatronStrategy(tensor_parallel_size=" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["gpt2", "--layouts"], ["--layouts needs --seq-len"]),
        (["gpt2", "--layouts", "--seq-len", "64", "--layers", "2"], ["--layers, --hidden and --heads go together"]),
    ],
)
def test_cli_layouts_bad_input(argv, words, capsys):
    pytest.importorskip("transformers")
    assert cli.main(["estimate-memory", *argv]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


@pytest.mark.parametrize(
    "argv, words",
    [
        # a negative length ended in a torch traceback from the activation measurement
        (["--seq-len", "-5"], "argument --seq-len: -5 must be >= 1"),
        (["--seq-len", "64", "--micro-batch-size", "0"], "argument --micro-batch-size: 0 must be >= 1"),
        (["--seq-len", "many"], "argument --seq-len: 'many' is not a whole number"),
    ],
)
def test_cli_layouts_counts_below_one_are_usage_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["estimate-memory", "gpt2", "--layouts", *argv])
    assert exited.value.code == 2 and words in capsys.readouterr().err
