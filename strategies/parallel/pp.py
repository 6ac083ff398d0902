"""Pipeline parallelism: a model's repeated blocks split into stages, run by a ``torch.distributed.pipelining``
schedule (the first step of the order in ``strategies/parallel/__init__.py``).

The pipelined model is the module that owns the largest ``nn.ModuleList`` of blocks inside the
``TrainingModule`` (``self.net`` of a GPT: ``net.blocks``), or, through the Accelerator, the
prepared model itself. Its children registered before the
block list (embedding) go to the first stage, those after it (final norm, head) to the last one;
the blocks are cut into contiguous groups balanced by parameter count, or where ``pp_split``
names the first block of each later stage (``["net.blocks.4"]``).

No weight is copied. On each rank the user's module keeps only the modules of its own stages
(the others become ``nn.Identity``), so its parameter names are the original model's and
checkpoints interchange between layouts. Each stage is a shallow *skeleton* of the pipelined
model (same class, same forward) whose children are the stage's own modules or identities; it is
what ``PipelineStage`` runs and FSDP2 shards. Contract this implies, checked where possible:
the pipelined model's ``forward`` is a chain of its children (``embed -> blocks -> norm -> head``,
an identity passing the previous stage's activations through), and it has no parameters of its
own. Parameters tied across stages (input/output embeddings) are kept on each stage that uses them,
their gradients summed over the ranks holding them (Megatron's embedding group).

A transformers ``*ForCausalLM`` (``LlamaForCausalLM``: base model ``model`` owning ``layers``, head
``lm_head`` beside it) is split too: its head goes to the last stage (``PipelineSplit.heads``), its
parameterless children (rotary embeddings) run on every stage, and each stage is a
``CausalLMStage``: the base model fed token ids on the first stage, the previous stage's hidden
states as ``inputs_embeds`` on the others (base models that scale or add to ``inputs_embeds``,
GPT-2's position embeddings or Gemma's scaling, do not fit: see ``CausalLMStage``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from trainforge.strategies.errors import ConfigurationError, invalid_choice

#: schedule name -> torch class name; single: one stage per rank, looped: several (stage s on rank s % pp)
SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
LOOPED = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
}
#: V-shaped: two stages per rank, rank r runs stages r and 2 pp - 1 - r (first and last on rank 0)
V_SHAPED = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
SCHEDULES = tuple(SINGLE) + tuple(LOOPED) + tuple(V_SHAPED)
STAGES_PER_RANK = 2  # default for looped schedules when pp_split does not fix the number of stages


@dataclass
class PipelineSplit:
    """Which children of the pipelined model each stage holds, computed once on the whole model."""

    prefix: str  # path of the pipelined model in the root module ("net")
    blocks: str  # attribute of its block list ("blocks")
    stages: List[List[str]]  # per stage: child names of the pipelined model ("embed", "blocks.0", ...)
    numels: List[int]  # parameters per stage (for the log line)
    tied: List[List[Tuple[int, str]]] = field(default_factory=list)  # per tied parameter: (stage, full name)
    heads: List[str] = field(default_factory=list)  # causal LM: root paths of the modules after the base model

    def stage_of(self, child: str) -> int:
        return next(i for i, names in enumerate(self.stages) if child in names)

    def child(self, name: str) -> Optional[str]:
        """The pipelined model's child (``embed``, ``blocks.3``) that a root-level name lies in, or
        the head (``net.lm_head``) of a causal LM; None outside."""
        for path in self.heads:
            if name == path or name.startswith(path + "."):
                return path
        head = self.prefix + "." if self.prefix else ""
        return child_of(name[len(head) :], self.blocks) if name.startswith(head) else None

    def qualified(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def describe(self) -> str:
        return "; ".join(
            f"stage {i}: {_span(names)} ({n} params)" for i, (names, n) in enumerate(zip(self.stages, self.numels))
        )


def _span(names: List[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]} ... {names[-1]} ({len(names)})"


def schedule_class(name: str) -> Any:
    import torch.distributed.pipelining.schedules as schedules

    if name not in SCHEDULES:
        raise invalid_choice("schedule", name, SCHEDULES)
    return getattr(schedules, {**SINGLE, **LOOPED, **V_SHAPED}[name])


def stage_rank(stage: int, pp: int, num_stages: int, schedule: str) -> int:
    """The pipeline rank running ``stage``: looped ``stage % pp``; V-shaped ``stage`` on the way down,
    ``2 pp - 1 - stage`` on the way back."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stage_ids(pp_rank: int, pp: int, num_stages: int, schedule: str = "1f1b") -> List[int]:
    """The stages a pipeline rank runs (``stage_rank`` inverted)."""
    return [s for s in range(num_stages) if stage_rank(s, pp, num_stages, schedule) == pp_rank]


def num_stages_for(schedule: str, pp: int, pp_split: Optional[Sequence[str]]) -> int:
    if pp_split is not None:
        n = len(pp_split) + 1
        if schedule in SINGLE and n != pp:
            raise ConfigurationError(
                f"pp_split={list(pp_split)!r} makes {n} stages, but schedule={schedule!r} runs one "
                f"stage per rank: give pipeline_parallel_size - 1 = {pp - 1} cut point(s)"
            )
        if schedule in V_SHAPED and n != 2 * pp:
            raise ConfigurationError(
                f"pp_split={list(pp_split)!r} makes {n} stages; schedule={schedule!r} runs two "
                f"stages per rank: give 2 x pipeline_parallel_size - 1 = {2 * pp - 1} cut points"
            )
        if schedule in LOOPED and (n % pp or n < 2 * pp):
            raise ConfigurationError(
                f"pp_split={list(pp_split)!r} makes {n} stages; schedule={schedule!r} runs several "
                f"stages per rank, so give a multiple of pipeline_parallel_size={pp} stages "
                f"(at least {2 * pp}, i.e. {2 * pp - 1} or more cut points)"
            )
        return n
    return pp if schedule in SINGLE else STAGES_PER_RANK * pp


def find_blocks(root: nn.Module, allow_root: bool = False) -> Tuple[str, str]:
    """(path of the pipelined model, attribute of its block list): the ModuleList with most parameters.
    ``allow_root``: the root itself may be the pipelined model (a plain model through the Accelerator)."""
    best: Optional[Tuple[int, str]] = None
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 1 and name:
            numel = sum(p.numel() for p in module.parameters())
            if numel and (best is None or numel > best[0]):
                best = (numel, name)
    if best is None:
        raise ConfigurationError(
            f"{type(root).__name__} has no nn.ModuleList of blocks to split into pipeline stages; "
            "keep the repeated blocks in an nn.ModuleList (e.g. self.net.blocks)"
        )
    prefix, _, attr = best[1].rpartition(".")
    if not prefix and not allow_root:
        raise ConfigurationError(
            f"the block list {best[1]!r} sits directly on {type(root).__name__}; pipeline "
            "parallelism splits a model held by the TrainingModule: put the model in an attribute "
            "(self.net = GPT(...)) whose forward is embed -> blocks -> head"
        )
    return prefix, attr


def plan_split(
    root: nn.Module, num_stages: int, pp_split: Optional[Sequence[str]] = None, allow_root: bool = False
) -> PipelineSplit:
    """The stages of ``root``'s pipelined model; every error names the sizes and the fix."""
    prefix, attr = find_blocks(root, allow_root)
    model = root.get_submodule(prefix)
    split = PipelineSplit(prefix, attr, [], [])
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise ConfigurationError(
            f"{prefix or 'the model'} ({type(model).__name__}) has parameters of its own "
            f"({', '.join(own[:3])}); "
            "pipeline stages hold whole submodules: move them into a submodule (e.g. the "
            "embedding) so that one stage owns them"
        )
    split.heads = causal_lm_heads(root, prefix)
    outside = [n for n, _ in root.named_parameters() if split.child(n) is None]
    if outside:
        raise ConfigurationError(
            f"{type(root).__name__} has parameters outside the pipelined model {prefix} (the owner "
            f"of the block list): {', '.join(outside[:3])}; pipeline stages split one model whose "
            "forward is embed -> blocks -> head, all inside it (or a transformers *ForCausalLM: "
            "its base model, named by base_model_prefix, then its head)"
        )
    children = list(model.named_children())
    if split.heads:  # parameterless children (rotary embeddings) run on every stage
        children = [(n, m) for n, m in children if n == attr or any(True for _ in m.parameters())]
    at = [n for n, _ in children].index(attr)
    pre, post = [n for n, _ in children[:at]], [n for n, _ in children[at + 1 :]] + split.heads
    blocks = getattr(model, attr)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    sub = lambda n: root.get_submodule(n) if n in split.heads else model.get_submodule(n)  # noqa: E731
    count = lambda names: sum(p.numel() for n in names for p in sub(n).parameters())  # noqa: E731
    if num_stages > len(blocks):
        raise ConfigurationError(
            f"{num_stages} pipeline stages but {split.qualified(attr)} has only {len(blocks)} "
            "block(s); "
            "each stage needs at least one block: lower pipeline_parallel_size (or the stages "
            "per rank of an interleaved schedule) or use a deeper model"
        )
    if pp_split is not None:
        cuts = _cut_indices(pp_split, split.qualified(attr), len(blocks))
    else:
        cuts = _balanced_cuts(sizes, num_stages, count(pre), count(post))
    bounds = [0, *cuts, len(blocks)]
    stages = [[f"{attr}.{i}" for i in range(lo, hi)] for lo, hi in zip(bounds, bounds[1:])]
    stages[0][:0] = pre
    stages[-1].extend(post)
    split.stages, split.numels = stages, [count(s) for s in stages]
    split.tied = _tied(root, split)
    return split


def _cut_indices(pp_split: Sequence[str], blocks: str, n: int) -> List[int]:
    valid = [f"{blocks}.{i}" for i in range(1, n)]
    cuts = []
    for name in pp_split:
        if name not in valid:
            raise ConfigurationError(
                f"pp_split entry {name!r} is not a block that can begin a stage; valid cut points: "
                f"{', '.join(valid)} (each names the first block of a new stage)"
            )
        cuts.append(int(name.rsplit(".", 1)[1]))
    if cuts != sorted(set(cuts)):
        raise ConfigurationError(f"pp_split={list(pp_split)!r} must name distinct blocks in increasing order")
    return cuts


def _balanced_cuts(sizes: List[int], k: int, first_extra: int, last_extra: int) -> List[int]:
    """Contiguous groups of blocks minimising the largest stage (embedding and head counted in)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def cost(lo: int, hi: int, stage: int) -> int:
        return prefix[hi] - prefix[lo] + (first_extra if stage == 0 else 0) + (last_extra if stage == k - 1 else 0)

    # best[j][i]: the smallest largest-stage cost of the first i blocks in j stages, and the last cut
    inf = float("inf")
    best = [[(inf, 0)] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, 0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            best[j][i] = min((max(best[j - 1][c][0], cost(c, i, j - 1)), c) for c in range(j - 1, i))
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = best[j][i][1]
        cuts.append(i)
    return sorted(cuts)


def _tied(root: nn.Module, split: PipelineSplit) -> List[List[Tuple[int, str]]]:
    """Parameters registered under several names that land on different stages."""
    by_id: Dict[int, List[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    tied = []
    for names in by_id.values():
        if len(names) < 2:
            continue
        outside = [n for n in names if split.child(n) is None]
        if outside:
            raise ConfigurationError(
                f"parameter {names[0]!r} is shared with {outside[0]!r}, outside the pipelined "
                f"model {split.prefix}; pipeline stages can only share parameters inside it"
            )
        placed = sorted({(split.stage_of(child), n) for n in names if (child := split.child(n)) is not None})
        if len({s for s, _ in placed}) > 1:
            tied.append(placed)
    return tied


def check_tied_placement(split: PipelineSplit, pp: int, schedule: str) -> None:
    """A parameter tied between two stages of one rank would be scaled twice by the schedule (and
    sharded twice by FSDP): refused before anything moves."""
    n = len(split.stages)
    for placed in split.tied:
        stages = sorted({s for s, _ in placed})
        ranks = [stage_rank(s, pp, n, schedule) for s in stages]
        if len(set(ranks)) < len(ranks):
            names = " = ".join(name for _, name in placed)
            raise ConfigurationError(
                f"tied parameter {names} is used by stages {stages}, which run on pipeline ranks "
                f"{ranks} (schedule={schedule!r}, {n} stages on {pp} ranks): two stages on one "
                "rank cannot share it; untie it, or use a schedule that puts the first and last "
                "stage on different ranks (gpipe, 1f1b, interleaved_1f1b, ...)"
            )


def child_of(name: str, blocks: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == blocks else parts[0]


#: transformers model types whose base model uses ``inputs_embeds`` as they are (rotary positions)
CAUSAL_LM_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class PassThrough(nn.Identity):
    """What a module of another stage becomes: its first input, whatever else it is called with."""

    def forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        return input


def _kept_everywhere(split: PipelineSplit, module: Optional[nn.Module]) -> bool:
    """A causal LM's parameterless children (rotary embeddings) are computed on every stage."""
    if not split.heads:
        return False
    if module is None:  # a child registered as None has no parameters() to look at
        raise AttributeError("'NoneType' object has no attribute 'parameters'")
    return not any(True for _ in module.parameters())


def prune(root: nn.Module, split: PipelineSplit, local: Sequence[int]) -> None:
    """Keep in ``root`` only the modules of the local stages (others become ``PassThrough``)."""
    keep = {name for s in local for name in split.stages[s]}
    model = root.get_submodule(split.prefix)
    blocks = getattr(model, split.blocks)
    for i in range(len(blocks)):
        if f"{split.blocks}.{i}" not in keep:
            blocks[i] = PassThrough()
    for name in list(model._modules):
        if name != split.blocks and name not in keep and not _kept_everywhere(split, model._modules[name]):
            model._modules[name] = PassThrough()
    for path in split.heads:
        if path not in keep:
            parent, _, name = path.rpartition(".")
            root.get_submodule(parent)._modules[name] = PassThrough()


def stage_module(root: nn.Module, split: PipelineSplit, stage: int) -> nn.Module:
    """A skeleton of the pipelined model (same class and forward, no ``__init__`` run) holding the
    stage's own modules, shared with ``root``, and pass-throughs elsewhere (a causal LM: wrapped
    with its head in ``CausalLMStage``)."""
    model = root.get_submodule(split.prefix)
    skeleton = model.__class__.__new__(model.__class__)
    skeleton.__dict__.update(
        {k: copy.copy(v) if isinstance(v, dict) else v for k, v in model.__dict__.items() if k != "forward"}
    )
    names = set(split.stages[stage])
    blocks = getattr(model, split.blocks)
    skeleton._modules[split.blocks] = nn.ModuleList(
        b if f"{split.blocks}.{i}" in names else PassThrough() for i, b in enumerate(blocks)
    )
    for name in list(skeleton._modules):
        if name != split.blocks and name not in names and not _kept_everywhere(split, skeleton._modules[name]):
            skeleton._modules[name] = PassThrough()
    if split.heads:
        return CausalLMStage(skeleton, [root.get_submodule(h) for h in split.heads if h in names], stage == 0)
    return skeleton


def stage_blocks(stage: nn.Module, split: PipelineSplit) -> List[nn.Module]:
    """The stage's own blocks (FSDP2's units)."""
    model = stage.base if isinstance(stage, CausalLMStage) else stage
    return [b for b in getattr(model, split.blocks) if not isinstance(b, nn.Identity)]


def causal_lm_heads(root: nn.Module, prefix: str) -> List[str]:
    """A transformers ``*ForCausalLM`` holding the block list's owner as its base model
    (``base_model_prefix``): the root paths of its other children with parameters (``lm_head``)."""
    parent_path, _, attr = prefix.rpartition(".")
    parent = root.get_submodule(parent_path) if prefix else None
    if parent is None or getattr(parent, "base_model_prefix", None) != attr or not hasattr(parent, "config"):
        return []
    kind = getattr(parent.config, "model_type", None)
    if kind not in CAUSAL_LM_TYPES:
        raise ConfigurationError(
            f"pipeline parallelism of a transformers {type(parent).__name__} (model_type={kind!r}) "
            "is not built yet: later stages feed hidden states to its base model as inputs_embeds, "
            f"checked for model types {', '.join(CAUSAL_LM_TYPES)} (others may scale or add "
            "position embeddings to them); wrap the model in your own embed -> blocks -> head "
            "module, or train it without pipeline_parallel_size"
        )
    return [
        f"{parent_path}.{n}" if parent_path else n
        for n, m in parent.named_children()
        if n != attr and any(True for _ in m.parameters())
    ]


class CausalLMStage(nn.Module):
    """One stage of a transformers causal LM: the base model's skeleton fed token ids (first stage)
    or the previous stage's hidden states as ``inputs_embeds``, then the head on the last stage.
    Fits base models whose forward adds nothing to ``inputs_embeds`` (Llama, Mistral, Qwen2/3: rotary
    positions); one that scales or adds position embeddings to them (GPT-2, Gemma) would apply that
    on every stage."""

    def __init__(self, base: nn.Module, heads: List[nn.Module], first: bool) -> None:
        super().__init__()
        self.base, self.heads, self.first = base, nn.ModuleList(heads), first

    def forward(self, x: Any) -> Any:
        out = self.base(input_ids=x, use_cache=False) if self.first else self.base(inputs_embeds=x, use_cache=False)
        hidden = out[0] if isinstance(out, (tuple, dict)) else out
        for head in self.heads:
            hidden = head(hidden)
        return hidden


def guard_forward(root: nn.Module, split: PipelineSplit) -> None:
    """The pruned model holds only some stages: calling it directly would compute nonsense."""
    model = root.get_submodule(split.prefix)

    def split_forward(*args: Any, **kwargs: Any) -> Any:
        raise ConfigurationError(
            f"{split.prefix or 'the model'} ({type(model).__name__}) is split into pipeline "
            "stages; it cannot be "
            "called directly (the Trainer's validation/test run the stages' loss_fn; prediction "
            "under pipeline parallelism is not built yet: predict on one process from the "
            "merged weights)"
        )

    model.forward = split_forward
