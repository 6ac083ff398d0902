"""Launched on 2 processes: gather_for_metrics over an odd-sized dataset, collectives, sync_dist."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Accelerator
from trainforge.strategies import ConfigurationError, DDPStrategy


class Indices(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i), {"double": torch.tensor(2 * i)}


def fp16_hook_trains_in_step():
    """DDP with fp16 gradient compression: a few SGD steps, then the ranks' weights must agree."""
    acc = Accelerator(strategy=DDPStrategy(comm_hook="fp16"))
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = acc.prepare(net, opt)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + acc.process_index))
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = acc.gather(weights.unsqueeze(0))
    return bool(torch.equal(both[0], both[1])) and not torch.equal(weights, torch.zeros_like(weights))


def no_sync_then_trigger():
    """Accelerate test_sync: grads differ across ranks after a backward in no_sync, agree after the
    next backward inside trigger_sync_in_backward (which syncs the accumulated gradients)."""
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(4, 1))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(acc.process_index))
    with acc.no_sync(model):
        acc.backward(model(x).pow(2).mean())
        grads = acc.gather(model.module.weight.grad.detach().clone().unsqueeze(0))
        differ = not torch.equal(grads[0], grads[1])
        with acc.trigger_sync_in_backward(model):  # inside no_sync: this backward syncs all the same
            acc.backward(model(x).pow(2).mean())
    grads = acc.gather(model.module.weight.grad.detach().clone().unsqueeze(0))
    return [differ, bool(torch.equal(grads[0], grads[1]))]


def main(out):
    acc = Accelerator()
    rank = acc.process_index
    loader = acc.prepare(DataLoader(Indices(13), batch_size=4))
    seen, doubled, per_rank = [], [], []
    for idx, extra in loader:
        per_rank.extend(idx.tolist())
        gathered_idx, gathered_extra = acc.gather_for_metrics((idx, extra))
        seen.extend(gathered_idx.tolist())
        doubled.extend(gathered_extra["double"].tolist())
    ragged = torch.arange(rank + 2)  # rank r has r + 2 elements
    padded = acc.pad_across_processes(ragged, pad_index=-1)
    result = {
        "seen": seen,
        "doubled": doubled,
        "per_rank": acc.strategy.all_gather_object(per_rank),
        "gathered_scalar": acc.gather(torch.tensor(float(rank))).tolist(),
        "reduce_sum": float(acc.reduce(torch.tensor(float(rank + 1)), "sum")),
        "reduce_mean": float(acc.reduce(torch.tensor(float(rank + 1)), "mean")),
        "reduce_max": float(acc.reduce(torch.tensor(float(rank + 1)), "max")),
        "broadcast": acc.broadcast({"from": rank}, src=1),
        "padded": acc.gather(padded).tolist(),
        # after the loop, outside any dataloader: a plain gather (3 rows per rank -> 6)
        "after_loop_rows": acc.gather_for_metrics(torch.full((3,), float(rank))).tolist(),
    }
    # Accelerate's process control and data options on 2 processes
    result["gather_object"] = acc.gather_object([f"r{rank}"])
    order_file = out + ".order"
    with acc.main_process_first(), open(order_file, "a") as f:
        f.write(f"{rank}\n")
    acc.wait_for_everyone()
    result["main_first_order"] = open(order_file).read().split()
    result["on_process_1"] = acc.gather_object([acc.on_process(lambda: rank, process_index=1)()])
    uneven = Accelerator(even_batches=False).prepare(DataLoader(Indices(13), batch_size=4))
    result["uneven_counts"] = acc.gather_object([sum(len(b[0]) for b in uneven)])
    split = Accelerator(split_batches=True).prepare(DataLoader(Indices(16), batch_size=8))
    result["split_batch_sizes"] = acc.gather_object([len(next(iter(split))[0])])
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    sched = Accelerator().prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    sched.step()  # Accelerate: once per process -> twice on 2 processes
    result["lr_after_one_step"] = opt.param_groups[0]["lr"]
    result["no_sync_then_trigger"] = no_sync_then_trigger()
    with acc.split_between_processes(list(range(5))) as part:
        result["split"] = acc.strategy.all_gather_object(part)
    result["fp16_hook_weights_agree"] = fp16_hook_trains_in_step()
    try:
        Accelerator(strategy=DDPStrategy(comm_hook="bf16")).prepare(torch.nn.Linear(2, 2))
        result["bf16_hook_error"] = None
    except ConfigurationError as exc:
        result["bf16_hook_error"] = str(exc)
    if acc.is_main_process:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
