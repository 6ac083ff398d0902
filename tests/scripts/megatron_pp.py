"""MegatronStrategy pipeline parallelism on real gloo processes, for tests/strategies/test_megatron_pp.py.

    torchrun --nproc-per-node 4 megatron_pp.py tp2pp2 OUT  # TP=2 x PP=2, 20 steps, saves OUT/ckpt_tp2pp2; pp2 x dp2
    torchrun --nproc-per-node 2 megatron_pp.py pp2 OUT     # schedules, validation, tied, resume, layouts, HF Llama

Every rank also trains the single-process reference itself (same seed, same batches, same
clipping), so parity is computed in-process; rank 0 writes OUT/<mode>.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_common import Block, loader, write_json
from safetensors.torch import load_file, save_file
from torch import nn

from trainforge import Accelerator, Trainer, TrainingModule
from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.megatron import MegatronStrategy

VOCAB, DIM, DEPTH = 32, 16, 4
PLAN = {"net.blocks.*.mlp.0": "colwise", "net.blocks.*.mlp.2": "rowwise", "net.head": "colwise_rep"}


class GPT(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LitGPT(TrainingModule):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = GPT(tied)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # the pipeline's loss
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:  # without pipelining; with it, loss_fn
        x, y = batch
        self.log("val/loss", self.loss_fn(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class LitLlama(LitGPT):
    """A transformers LlamaForCausalLM (its lm_head outside the base model that owns the layers)."""

    def __init__(self, tied: bool = False) -> None:
        TrainingModule.__init__(self)
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.net = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=DIM,
                intermediate_size=2 * DIM,
                num_hidden_layers=DEPTH,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=tied,
            )
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.net(input_ids=x).logits, y)


class Record(Callback):
    """Losses (what the step returned) and, at ``save_at``, a checkpoint."""

    def __init__(self, save_at: int = -1, path: Any = None) -> None:
        self.losses: List[float] = []
        self.save_at, self.path = save_at, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs))
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(str(self.path))


def fit(
    strategy: Any,
    root: Path,
    steps: int,
    tied: bool = False,
    ckpt_path: Any = None,
    batch_size: int = 4,
    module_cls: Any = LitGPT,
    **kw: Any,
) -> Any:
    record = Record(**kw)
    trainer = Trainer(
        strategy=strategy,
        max_steps=steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        seed=0,
        gradient_clip_val=0.5,
        callbacks=[record],
    )
    module = module_cls(tied)
    trainer.fit(module, loader(batch_size), ckpt_path=ckpt_path)
    return trainer, module, record.losses


def reference(steps: int, tied: bool = False, batch_size: int = 4, module_cls: Any = LitGPT) -> Dict[str, Any]:
    module = module_cls(tied)
    opt = module.configure_optimizers()
    losses = []
    for i, (x, y) in enumerate(loader(batch_size)):
        if i == steps:
            break
        loss = module.training_step((x, y), i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def diff(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def state_diff(trainer: Trainer, ref: Dict[str, torch.Tensor]) -> float:
    full = trainer.strategy.module_state_dict(trainer.model)  # gathered over the pipeline
    assert sorted(full) == sorted(ref), (sorted(full), sorted(ref))
    return max(float((full[k] - ref[k]).abs().max()) for k in ref)


def pp2(out: Path) -> Dict[str, Any]:  # noqa: PLR0915 - one rank's scenario, read top to bottom
    res: Dict[str, Any] = {}
    ref = reference(6)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv"):
        strategy = MegatronStrategy(pipeline_parallel_size=2, schedule=schedule)
        trainer, _, losses = fit(strategy, out / f"run_{schedule}", 6)
        res[f"{schedule}_loss_diff"] = diff(losses, ref["losses"])
        res[f"{schedule}_weights_diff"] = state_diff(trainer, ref["state"])
        res[f"{schedule}_stages"] = [s.stage_index for s in strategy.pipeline.stages]
        res[f"{schedule}_local_params"] = sorted(
            {n.split(".")[1] + (("." + n.split(".")[2]) if ".blocks." in n else "") for n in strategy._params}
        )
    # validation through the stages (forward only): the sanity check, then after steps 3 and 6
    record = Record()
    trainer = Trainer(
        strategy=MegatronStrategy(pipeline_parallel_size=2),
        max_steps=6,
        val_check_interval=3,
        limit_val_batches=2,
        default_root_dir=str(out / "run_val"),
        enable_progress_bar=False,
        enable_checkpointing=False,
        seed=0,
        gradient_clip_val=0.5,
        callbacks=[record],
    )
    trainer.fit(LitGPT(), loader(4), loader(4))
    trained = LitGPT()
    trained.load_state_dict(ref["state"])
    with torch.no_grad():
        expected = sum(float(trained.training_step(b, i)) for i, b in zip(range(2), loader(4))) / 2
    res["val_loss_diff"] = abs(float(trainer.callback_metrics["val/loss"]) - expected)
    res["val_train_loss_diff"] = diff(record.losses, ref["losses"])  # validation leaves training as it was
    # activation checkpointing of each stage's blocks: the same numbers
    strategy = MegatronStrategy(pipeline_parallel_size=2, activation_checkpointing=True)
    trainer, _, losses = fit(strategy, out / "run_ac", 6)
    res["ac_loss_diff"], res["ac_weights_diff"] = diff(losses, ref["losses"]), state_diff(trainer, ref["state"])
    res["ac_wrapped"] = sum(type(b).__name__ == "CheckpointWrapper" for b in strategy.pipeline.stages[0].submod.blocks)
    # tied input/output embeddings: one copy on the first stage, one on the last, gradients summed
    tied_ref = reference(6, tied=True)
    strategy = MegatronStrategy(pipeline_parallel_size=2, schedule="1f1b", pp_split=["net.blocks.1"])
    trainer, module, losses = fit(strategy, out / "run_tied", 6, tied=True)
    res["tied_loss_diff"] = diff(losses, tied_ref["losses"])
    res["tied_weights_diff"] = state_diff(trainer, tied_ref["state"])
    res[f"pp_split_rank{dist.get_rank()}_blocks"] = sorted(
        {n.split(".")[2] for n in strategy._params if ".blocks." in n}
    )
    mine = "net.embed.weight" if dist.get_rank() == 0 else "net.head.weight"
    res[f"tied_rank{dist.get_rank()}_holds"] = sorted(
        k for k in strategy._params if k in ("net.embed.weight", "net.head.weight")
    )
    tied_weights = [None, None]
    dist.all_gather_object(tied_weights, strategy._params[mine].detach().clone())
    res["tied_copies_equal"] = bool(torch.equal(tied_weights[0], tied_weights[1]))

    # checkpoint: save at step 3 on pp2 (1f1b), resume on the same layout: the same losses and weights
    trainer, _, losses = fit(
        MegatronStrategy(pipeline_parallel_size=2), out / "run_save", 6, save_at=3, path=out / "ckpt_pp2"
    )
    full = trainer.strategy.module_state_dict(trainer.model)
    resumed, _, losses2 = fit(
        MegatronStrategy(pipeline_parallel_size=2), out / "run_resumed", 6, ckpt_path=str(out / "ckpt_pp2")
    )
    res["resume_losses_equal"] = losses2 == losses[3:]
    res["resume_weights_diff"] = max(
        float((v - full[k]).abs().max()) for k, v in resumed.strategy.module_state_dict(resumed.model).items()
    )
    at3 = reference(3)["state"]  # the weights the checkpoint holds, for the one-process load in the test
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in at3.items()}, str(out / "ref_step3.safetensors"))
    accelerator_run(res)
    llama(res, out)
    res["compile"] = refused(MegatronStrategy(pipeline_parallel_size=2), compile=True)
    res["manual"] = refused(MegatronStrategy(pipeline_parallel_size=2), manual=True)
    # Trainer.validate on its own (no fit): the module is split then, the loss runs through the stages
    [metrics] = Trainer(  # one dict per validation loader, as Lightning's validate returns
        strategy=MegatronStrategy(pipeline_parallel_size=2),
        limit_val_batches=2,
        max_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(out / "run_validate"),
    ).validate(LitGPT(), loader(4))
    fresh = LitGPT()
    with torch.no_grad():
        expected = sum(float(fresh.training_step(b, i)) for i, b in zip(range(2), loader(4))) / 2
    res["validate_diff"] = abs(metrics["val/loss"] - expected)
    res["bad_batch"] = refused(MegatronStrategy(pipeline_parallel_size=2, num_microbatches=3))
    short = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*next(iter(loader(10)))), batch_size=4)
    res["last_batch"] = refused(MegatronStrategy(pipeline_parallel_size=2), data=short)
    res["schedule_microbatches"] = refused(
        MegatronStrategy(pipeline_parallel_size=2, schedule="interleaved_1f1b", num_microbatches=5), data=loader(10)
    )
    # the tp2 x pp2 checkpoint (4 processes, written first) loaded on pp2: the weights it was saved with
    if (out / "ckpt_tp2pp2").is_dir():
        strategy = MegatronStrategy(pipeline_parallel_size=2)
        strategy.setup_environment()
        torch.manual_seed(1)
        module, _ = strategy.setup(LitGPT(), lambda: [])
        strategy.load_checkpoint(out / "ckpt_tp2pp2", module, [])
        loaded = strategy.module_state_dict(module)
        saved = load_file(str(out / "tp2pp2.safetensors"))
        res["tp2pp2_to_pp2_diff"] = max(float((loaded[k] - saved[k]).abs().max()) for k in saved)
        # the same checkpoint's weights on dp2 (FSDP2 only), and a full resume (optimizer too) on pp2
        strategy = MegatronStrategy(tensor_parallel_size=1)
        strategy.setup_environment()
        module = strategy.setup_module(LitGPT())
        strategy.load_checkpoint(out / "ckpt_tp2pp2", module, [])
        loaded = strategy.module_state_dict(module)
        res["tp2pp2_to_dp2_layout"] = str(strategy.dims)
        res["tp2pp2_to_dp2_diff"] = max(float((loaded[k] - saved[k]).abs().max()) for k in saved)
        _, _, resumed_losses = fit(
            MegatronStrategy(pipeline_parallel_size=2),
            out / "run_tp2pp2_on_pp2",
            24,
            ckpt_path=str(out / "ckpt_tp2pp2"),
        )
        res["tp2pp2_resumed_on_pp2_loss_diff"] = diff(resumed_losses, reference(24)["losses"][20:])
    # the pp2 checkpoint (step 3) resumed on tp2 (no pipeline): the uninterrupted pp2 run's losses
    _, _, tp_losses = fit(
        MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN),
        out / "run_pp2_on_tp2",
        6,
        ckpt_path=str(out / "ckpt_pp2"),
    )
    res["pp2_resumed_on_tp2_loss_diff"] = diff(tp_losses, losses[3:])
    return res


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def accelerator_run(res: Dict[str, Any]) -> None:
    """The thin API on a plain model: optimizer built before prepare, one forward_backward per batch."""
    acc = Accelerator(strategy=MegatronStrategy(pipeline_parallel_size=2))
    torch.manual_seed(0)
    net = GPT()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    net, opt, dl = acc.prepare(net, opt, loader(4))
    res["accelerator_param_groups"] = len(opt.param_groups[0]["params"])  # this rank's stage only
    losses = []
    for i, batch in enumerate(dl):
        if i == 3:
            break
        loss = acc.forward_backward(net, batch, cross_entropy)
        acc.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    res["accelerator_loss_diff"] = diff(losses, reference(3)["losses"])
    try:
        acc.backward(torch.ones((), requires_grad=True))
        res["accelerator_backward"] = "no error"
    except ConfigurationError as e:
        res["accelerator_backward"] = str(e)


def refused(strategy: Any, data: Any = None, tied: bool = False, manual: bool = False, **kwargs: Any) -> str:
    """The ConfigurationError a fit raises before its first step."""
    record = Record()
    trainer = Trainer(
        strategy=strategy,
        max_steps=1,
        default_root_dir="/nonexistent-never-written",
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[record],
        **kwargs,
    )
    module = LitGPT(tied)
    module.automatic_optimization = not manual
    try:
        trainer.fit(module, data or loader(4))
    except ConfigurationError as e:
        return str(e) if not record.losses else "error after a step"
    return "no error"


def tp2pp2(out: Path) -> Dict[str, Any]:
    strategy = MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, tp_plan=PLAN)
    trainer, _, losses = fit(strategy, out / "run_tp2pp2", 20, save_at=20, path=out / "ckpt_tp2pp2")
    ref = reference(20)
    full = trainer.strategy.module_state_dict(trainer.model)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "tp2pp2.safetensors"))
    res = {
        "layout": str(strategy.dims),
        "steps": len(losses),
        "loss_diff": diff(losses, ref["losses"]),
        "weights_diff": max(float((full[k] - ref["state"][k]).abs().max()) for k in ref["state"]),
        "placements": str(next(p.placements for n, p in strategy._params.items() if "mlp.0.weight" in n)),
    }
    # the tp2 x pp2 checkpoint, optimizer state included, resumed under FSDPStrategy on the 4 processes
    from trainforge.strategies.fsdp import FSDPStrategy

    fsdp = FSDPStrategy()
    fsdp.setup_environment()
    lit = LitGPT()
    module, opts = fsdp.setup(lit, lambda: [lit.configure_optimizers()])
    fsdp.load_checkpoint(out / "ckpt_tp2pp2", module, opts)
    loaded = fsdp.module_state_dict(module)
    if dist.get_rank() == 0:
        res["tp2pp2_to_fsdp_diff"] = max(float((loaded[k] - full[k]).abs().max()) for k in full)
    res["tp2pp2_to_fsdp_steps"] = sorted({int(s["step"]) for s in opts[0].state.values()})
    # tied embeddings under tp2 x pp2: both uses sharded alike (vocab rows), gradients summed per shard
    tied_ref = reference(6, tied=True)
    plan = dict(PLAN, **{"net.embed": "embedding_rowwise"})
    trainer, _, losses = fit(
        MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, tp_plan=plan),
        out / "run_tp2pp2_tied",
        6,
        tied=True,
    )
    res.update(
        tied_tp2pp2_loss_diff=diff(losses, tied_ref["losses"]),
        tied_tp2pp2_weights_diff=state_diff(trainer, tied_ref["state"]),
    )
    res["tied_tp2pp2_mismatch"] = refused(
        MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, tp_plan=PLAN), tied=True
    )
    # pp2 x dp2: FSDP2 per stage; each dp rank its half of a global batch of 8, tied embeddings
    strategy = MegatronStrategy(pipeline_parallel_size=2, schedule="1f1b")
    trainer, _, losses = fit(strategy, out / "run_pp2dp2", 6, tied=True)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, losses)
    mean = [(a + b) / 2 for a, b in zip(per_rank[0], per_rank[1])]  # ranks 0, 1: dp 0 and 1 of stage 0
    ref = reference(6, tied=True, batch_size=8)
    res.update(
        pp2dp2_layout=str(strategy.dims),
        pp2dp2_loss_diff=diff(mean, ref["losses"]),
        pp2dp2_weights_diff=state_diff(trainer, ref["state"]),
        pp2dp2_placements=str(next(p.placements for n, p in strategy._params.items() if ".mix.weight" in n)),
    )
    # the same with data_parallel="ddp" (replicated per stage): the same losses
    ddp = MegatronStrategy(pipeline_parallel_size=2, schedule="1f1b", data_parallel="ddp")
    _, _, ddp_losses = fit(ddp, out / "run_pp2dp2_ddp", 3, tied=True)
    res.update(
        pp2dp2_ddp_loss_diff=diff(ddp_losses, losses[:3]),
        pp2dp2_ddp_steps=len(ddp_losses),
        pp2dp2_ddp_placements=str(next(p.placements for n, p in ddp._params.items() if ".mix.weight" in n)),
    )
    return res


def llama(res: Dict[str, Any], out: Path) -> None:
    """A transformers LlamaForCausalLM split into 2 stages (head on the last), untied and tied."""
    for tied, schedule in ((False, "1f1b"), (True, "gpipe")):
        trainer, _, losses = fit(
            MegatronStrategy(pipeline_parallel_size=2, schedule=schedule),
            out / f"run_llama_{tied}",
            3,
            tied=tied,
            module_cls=LitLlama,
        )
        ref = reference(3, tied=tied, module_cls=LitLlama)
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(trainer.strategy._params))
        res[f"llama_tied{int(tied)}"] = {
            "loss": diff(losses, ref["losses"]),
            "weights": state_diff(trainer, ref["state"]),
            "embed_on": [any("embed_tokens" in n for n in r) for r in names],
            "head_on": [any("lm_head" in n for n in r) for r in names],
            "layers_on": [sorted({n.split(".")[3] for n in r if ".layers." in n}) for r in names],
        }


def main(mode: str, out: Path) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("MEGATRON_DUMP_AFTER", "500")), exit=True)
    res = {"pp2": pp2, "tp2pp2": tp2pp2}[mode](out)
    if int(os.environ["RANK"]) == 0:
        write_json(out / f"{mode}.json", res)
    print(f"rank {os.environ['RANK']} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
