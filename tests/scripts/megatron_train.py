"""MegatronStrategy on real gloo processes, for tests/strategies/test_megatron.py.

    torchrun --nproc-per-node 4 megatron_train.py tp2dp2 OUT   # FSDP2 x TP=2, 20 steps, saves OUT/ckpt_tp2dp2
    torchrun --nproc-per-node 2 megatron_train.py tp2 OUT      # TP=2 (GPT + Llama), resume, reshard to dp2

Every rank also trains the unsharded reference itself (same seed, same global batches), so the
parity numbers are computed in-process; rank 0 writes OUT/<mode>.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_common import SEQ, LitLM, TinyLM, full_state, lm_loss, loader, make_trainer, write_json
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from trainforge import Accelerator, TrainingModule
from trainforge.callbacks.base import Callback
from trainforge.strategies.megatron import MegatronStrategy

PLAN = {
    "net.blocks.*.mix": "colwise_rep",
    "net.blocks.*.mlp.0": "colwise",
    "net.blocks.*.mlp.2": "rowwise",
    "net.head": "colwise_rep",
}
NET_PLAN = {k[len("net.") :]: v for k, v in PLAN.items()}


def fit(strategy: Any, root: Path, max_steps: int, ckpt_path: Any = None, module: Any = None, **kwargs: Any) -> Any:
    module = module if module is not None else LitLM()
    trainer = make_trainer(strategy, root, max_steps, **kwargs)
    trainer.fit(module, loader(kwargs.pop("batch_size", 4)), ckpt_path=ckpt_path)
    return trainer, module


def seeded_tinylm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


class SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(str(self.path))


def reference(make: Any, loss_fn: Any, steps: int, batch_size: int, clip: Any = 0.5) -> Dict[str, Any]:
    module = make()
    opt = torch.optim.AdamW(module.net.parameters(), lr=1e-2, weight_decay=0.01)
    losses: List[float] = []
    for i, batch in enumerate(loader(batch_size)):
        if i == steps:
            break
        loss = loss_fn(module.net, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in module.net.state_dict().items()}}


def gathered(obj: Any) -> List[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def grad_diff(make_net: Any, loss_fn: Any, plan: Any, **kwargs: Any) -> Any:
    """First-step gradients of the TP=2 model (gathered) against the unsharded model's; with
    ``kwargs`` (sequence/loss parallel) also the loss difference."""
    from trainforge.strategies.parallel.sp import loss_parallel_context

    strategy = MegatronStrategy(tensor_parallel_size=2, tp_plan=plan, **kwargs)
    strategy.setup_environment()
    ref, tp = make_net(), strategy.setup_module(make_net())
    batch = next(iter(loader(4)))
    ref_loss = loss_fn(ref, batch)
    ref_loss.backward()
    with loss_parallel_context():  # the Trainer's step runs under it (forward hooks + backward)
        loss = loss_fn(tp, batch)
        loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in tp.named_parameters()}
    diff = max_diff(grads, {n: p.grad for n, p in ref.named_parameters()})
    if not kwargs:
        return diff
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    seen: List[str] = []
    tp.get_submodule("model.layers.0.input_layernorm").register_forward_hook(
        lambda m, i, o: seen.append(str(getattr(o, "placements", None)))
    )
    logits = tp(batch[0]).logits
    return {
        "grad": diff,
        "loss": abs(float(loss) - float(ref_loss)),
        "logits": str(getattr(logits, "placements", None)),
        "norm_out": seen[0],
    }


class LitLlama(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.net = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=32,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
        self.losses: List[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = llama_loss(self.net, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def llama_loss(net: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(input_ids=x).logits.flatten(0, 1), y.flatten())


def tp2dp2(out: Path) -> Dict[str, Any]:
    trainer, module = fit(
        MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN),
        out / "run_tp2dp2",
        max_steps=20,
        callbacks=[SaveAt(20, out / "ckpt_tp2dp2")],
    )
    per_rank = gathered(module.losses)
    dims = trainer.strategy.dims
    weights = full_state(trainer)
    if dist.get_rank() == 0:
        save_file({k[len("net.") :]: v.contiguous() for k, v in weights.items()}, str(out / "tp2dp2.safetensors"))
    ref = reference(LitLM, lm_loss, 20, 8)
    # ranks 0,1 are dp rank 0 (tp 0,1), ranks 2,3 dp rank 1: the global loss is the mean over dp ranks
    mean = [(a + b) / 2 for a, b in zip(per_rank[0], per_rank[2])]
    # data_parallel="ddp": the same layout with replicated (not sharded) parameters on dp, same losses
    trainer_ddp, ddp = fit(
        MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN, data_parallel="ddp"),
        out / "run_ddp",
        max_steps=5,
        callbacks=[SaveAt(5, out / "ckpt_ddp")],
    )
    ddp_losses = gathered(ddp.losses)
    ddp_weights = full_state(trainer_ddp)
    fsdp = MegatronStrategy(tensor_parallel_size=2, tp_plan=NET_PLAN)  # its checkpoint loads under FSDP2 x TP
    fsdp.setup_environment()
    wrapper = torch.nn.Module()
    wrapper.net = fsdp.setup_module(seeded_tinylm())
    fsdp.load_checkpoint(out / "ckpt_ddp", wrapper, [])
    return {
        "ddp_loss_diff": max(abs(a - b) for r in (0, 2) for a, b in zip(ddp_losses[r], per_rank[r][:5])),
        "ddp_steps": len(ddp.losses),
        "ddp_ckpt_diff": max_diff(fsdp.module_state_dict(wrapper), ddp_weights),
        "ddp_placements": str(trainer_ddp.model.net.blocks[0].mlp[0].weight.placements),
        "layout": str(dims),
        "tp_ranks_equal": per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3],
        "loss_diff": max(abs(a - b) for a, b in zip(mean, ref["losses"])),
        "steps": len(mean),
        "placements": str(trainer.model.net.blocks[0].mlp[0].weight.placements),
    }


def accelerator_run() -> float:
    """The thin API: an optimizer built on the unsharded parameters, prepared with the model."""
    acc = Accelerator(strategy=MegatronStrategy(tensor_parallel_size=2, tp_plan=NET_PLAN))
    net = seeded_tinylm()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    net, opt, dl = acc.prepare(net, opt, loader(4))
    losses = []
    for i, batch in enumerate(dl):
        if i == 3:
            break
        loss = lm_loss(net, batch)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    ref = reference(lambda: type("M", (), {"net": seeded_tinylm()})(), lm_loss, 3, 4, clip=None)
    return max(abs(a - b) for a, b in zip(losses, ref["losses"]))


def tp2(out: Path) -> Dict[str, Any]:
    res: Dict[str, Any] = {}
    strategy = MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN)
    trainer, module = fit(strategy, out / "run_tp2", max_steps=6, callbacks=[SaveAt(3, out / "ckpt_tp2")])
    ref = reference(LitLM, lm_loss, 6, 4)
    res["gpt_loss_diff"] = max(abs(a - b) for a, b in zip(module.losses, ref["losses"]))
    res["gpt_steps"] = len(module.losses)
    res["coverage"] = strategy.tp_coverage["fraction"]
    res["placements"] = str(trainer.model.net.blocks[0].mlp[0].weight.placements)
    full = full_state(trainer)
    trainer2, module2 = fit(
        MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN),
        out / "resumed_tp2",
        max_steps=6,
        ckpt_path=str(out / "ckpt_tp2"),
    )
    res["resume_losses_equal"] = module2.losses == module.losses[3:]
    res["resume_weights_diff"] = max_diff(full_state(trainer2), full) if full else 0.0
    res["gpt_grad_diff"] = grad_diff(seeded_tinylm, lm_loss, NET_PLAN)

    res["accelerator_loss_diff"] = accelerator_run()
    res["llama_grad_diff"] = grad_diff(lambda: LitLlama().net, llama_loss, "auto")
    trainer3, module3 = fit(MegatronStrategy(tensor_parallel_size=2), out / "run_llama", max_steps=3, module=LitLlama())
    res["llama_loss_diff"] = max(
        abs(a - b) for a, b in zip(module3.losses, reference(LitLlama, llama_loss, 3, 4)["losses"])
    )

    res.update(auto_layouts(out, module3.losses))
    for name, kwargs in (
        ("sp", {"sequence_parallel": True}),
        ("lp", {"loss_parallel": True}),
        ("splp", {"sequence_parallel": True, "loss_parallel": True}),
    ):
        res[name] = grad_diff(lambda: LitLlama().net, llama_loss, "auto", **kwargs)
    trainer4, module4 = fit(
        MegatronStrategy(tensor_parallel_size=2, sequence_parallel=True, loss_parallel=True),
        out / "run_splp",
        max_steps=3,
        module=LitLlama(),
    )
    res["splp_trainer_loss_diff"] = max(abs(a - b) for a, b in zip(module4.losses, module3.losses))
    res["splp_trainer_steps"] = len(module4.losses)

    # the tp2 x dp2 checkpoint loaded on dp2 (tp=1): weights equal the ones it was saved with
    ckpt = out / "ckpt_tp2dp2"
    if ckpt.is_dir():
        dp2 = MegatronStrategy(tensor_parallel_size=1)
        dp2.setup_environment()
        torch.manual_seed(1)
        net = dp2.setup_module(TinyLM())
        wrapper = torch.nn.Module()
        wrapper.net = net
        dp2.load_checkpoint(ckpt, wrapper, [])
        loaded = {k[len("net.") :]: v for k, v in dp2.module_state_dict(wrapper).items()}
        res["dp2_layout"] = str(dp2.dims)
        if dist.get_rank() == 0:
            res["dp2_load_diff"] = max_diff(loaded, load_file(str(out / "tp2dp2.safetensors")))
    return res


def forcing_tp2_memory() -> int:
    """A device size between the tp2 layout's bytes and dp2's (dp2 holds more activations)."""
    from trainforge.strategies.memory_estimate import DEFAULT_HEADROOM
    from trainforge.strategies.parallel.layout import ModelShape, estimate_layouts, measure_activation_bytes

    net = LitLlama().net
    rows = {
        r.name: r.total
        for r in estimate_layouts(
            ModelShape.of(net, sum(p.numel() for p in net.parameters())),
            2,
            seq_len=SEQ,
            micro_batch_size=4,
            precision="32",
            ranks_per_node=2,
            measured_activations=measure_activation_bytes(net, SEQ, 4, "32"),
        )
    }
    tp2, dp2 = rows["pp=1 x dp=1 x tp=2"], rows["pp=1 x dp=2 x tp=1"]
    assert tp2 < dp2, rows
    return int((tp2 + dp2) / 2 / (1 - DEFAULT_HEADROOM))


def auto_layouts(out: Path, explicit_tp2_losses: List[float]) -> Dict[str, Any]:
    """'auto' sizes: the Trainer (loader prepared before the model) with a device that only tp2 fits,
    against the explicit tp=2 run; the Accelerator with room for dp2 (each rank its own shard); a
    loader prepared alone before the model is refused."""
    from trainforge.strategies.errors import ConfigurationError

    res: Dict[str, Any] = {}
    memory = forcing_tp2_memory()
    import logging

    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainforge").addHandler(handler)
    logging.getLogger("trainforge").setLevel(logging.INFO)
    auto = MegatronStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto", device_memory=memory)
    trainer, module = fit(auto, out / "run_auto", max_steps=3, module=LitLlama())
    logging.getLogger("trainforge").removeHandler(handler)
    res["auto_table"] = next((r for r in records if "'auto' layout" in r), "")
    res["auto_layout"] = str(trainer.strategy.dims)
    res["auto_loss_diff"] = max(abs(a - b) for a, b in zip(module.losses, explicit_tp2_losses))
    res["auto_steps"] = len(module.losses)

    acc = Accelerator(
        strategy=MegatronStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto", device_memory=10 * memory)
    )
    net = LitLlama().net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt, dl = acc.prepare(net, opt, loader(4))
    first = next(iter(dl))[0]
    res["acc_auto_layout"] = str(acc.strategy.dims)
    res["acc_auto_batches"] = len(dl)
    res["acc_auto_ranks_differ"] = not all(torch.equal(first, b) for b in gathered(first)[1:])
    try:
        Accelerator(strategy=MegatronStrategy(tensor_parallel_size="auto", seq_len=SEQ)).prepare(loader(4))
        res["acc_loader_first_error"] = ""
    except ConfigurationError as e:
        res["acc_loader_first_error"] = str(e)
    return res


def main(mode: str, out: Path) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("MEGATRON_DUMP_AFTER", "600")), exit=True)
    res = {"tp2dp2": tp2dp2, "tp2": tp2}[mode](out)
    if int(os.environ["RANK"]) == 0:
        write_json(out / f"{mode}.json", res)
    print(f"rank {os.environ['RANK']} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
