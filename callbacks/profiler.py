"""Profilers: ``PyTorchProfiler`` (torch.profiler traces, Lightning's name) and ``SimpleProfiler`` (a per-hook
timer). ``Trainer(profiler="simple" | "pytorch" | instance)`` installs one.

Both are ``HookProfiler`` callbacks: when one is among the Trainer's callbacks, the Trainer's one dispatch
point hands it every module and callback hook to wrap once per fit (``HookProfiler.wrap``), so a hook
costs nothing more when no profiler is installed. ``PyTorchProfiler`` wraps each hook in
``torch.profiler.record_function("<Class>.<hook>")`` and opens ranges around the loop's phases
(``[loop] training_batch``, ``training_step``, ``backward``, ``optimizer_step``, ``validation``) from the
events that bound them; ``SimpleProfiler`` adds each hook's wall time and reports at fit end, on rank 0,
which hook cost how much per optimizer step.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, record_function, tensorboard_trace_handler

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.strategies.files import open_new

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")
TRACE_HANDLERS = ("chrome", "tensorboard")
SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")
SORT_KEYS = tuple(
    f"{self_}{kind}_{what}"
    for self_ in ("", "self_")
    for kind in ("cpu", "cuda", "device")
    for what in ("time_total", "memory_usage")
) + ("cpu_time", "cuda_time", "device_time", "count")


def profiler_schedule(where: str, **steps: Optional[int]) -> Optional[Callable[[int], Any]]:
    """``torch.profiler.schedule`` from wait/warmup/active/repeat/skip_first, each checked (None: unset).
    All unset: None (every step is recorded)."""
    given = {k: v for k, v in steps.items() if v is not None}
    if not given:
        return None
    for key, value in given.items():
        if key not in SCHEDULE_KEYS:
            raise invalid_choice(f"{where} schedule key", key, SCHEDULE_KEYS)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigurationError(
                f"{where}: {key}={value!r} must be an int >= 0 (a number of steps), e.g. wait=1, warmup=1, active=2"
            )
    if given.get("active", 0) < 1:
        raise ConfigurationError(
            f"{where}: active={given.get('active', 0)!r} records no step; a schedule needs active >= 1 "
            f"(got {given}), e.g. wait=1, warmup=1, active=2"
        )
    return torch.profiler.schedule(
        wait=given.get("wait", 0),
        warmup=given.get("warmup", 0),
        active=given["active"],
        repeat=given.get("repeat", 0),
        skip_first=given.get("skip_first", 0),
    )


def writable_dir(path: Any, where: str) -> None:
    """Create ``path`` and check that a file can be written in it, or a ConfigurationError naming why."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigurationError(
            f"{where}={str(path)!r} cannot be written to ({err.strerror or err}): the report would be lost at "
            "the end of the fit. Pass a folder this process can write, or dirpath=None to print it only"
        ) from err


class HookProfiler(Callback):
    """A callback the Trainer hands every hook to wrap (once per fit, never its own hooks)."""

    def reset(self) -> None:
        """Called before the hooks of a fit (or validate/test/predict) are wrapped."""

    def wrap(self, name: str, hook: Callable[..., None]) -> Callable[..., None]:
        return hook


class SimpleProfiler(HookProfiler):
    """Each hook's wall time (``time.perf_counter``), reported at the end of fit (its teardown) on rank 0
    as a table sorted by cost: total seconds, milliseconds per optimizer step, calls. ``dirpath``/``filename``: also written to
    ``dirpath/filename`` (rank 0; ``<stem>-1<suffix>``... when that file exists, ``report_path`` says which).
    ``report`` holds the last table; ``totals`` ``{name: (seconds, calls)}``."""

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None) -> None:
        for name, value in (("dirpath", dirpath), ("filename", filename)):
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ConfigurationError(f"SimpleProfiler({name}={value!r}) must be a path or None")
        self.dirpath, self.filename = dirpath, filename
        self._totals: Dict[str, List[float]] = {}
        self._first_step = 0
        self._checked_dir = False
        self.report = ""
        self.report_path: Optional[str] = None  # where the report was written (a new file, never over one)

    def reset(self) -> None:
        self._totals = {}

    def wrap(self, name: str, hook: Callable[..., None]) -> Callable[..., None]:
        total = self._totals.setdefault(name, [0.0, 0])
        clock = time.perf_counter

        def timed(*args: Any) -> None:
            start = clock()
            try:
                hook(*args)
            finally:
                total[0] += clock() - start
                total[1] += 1

        return timed

    @property
    def totals(self) -> Dict[str, tuple]:
        return {name: (t[0], int(t[1])) for name, t in self._totals.items()}

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._first_step = trainer.global_step
        self._checked_dir = False
        if self.dirpath is not None:
            # the report is written after the whole fit: a folder it cannot be written to fails now
            writable_dir(self.dirpath, "SimpleProfiler(dirpath)")
            self._checked_dir = True

    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        """The report, once every other hook but teardown has run (this callback's hooks run first)."""
        if stage != "fit":
            return
        steps = max(trainer.global_step - self._first_step, 1)
        rows = sorted(((k, v) for k, v in self.totals.items() if v[1]), key=lambda item: -item[1][0])
        width = max([len(name) for name, _ in rows] + [4])
        lines = [f"{'hook':<{width}}  {'total s':>10}  {'ms/step':>10}  {'calls':>8}"]
        lines += [f"{name:<{width}}  {t:>10.4f}  {1000 * t / steps:>10.4f}  {n:>8}" for name, (t, n) in rows]
        self.report = f"SimpleProfiler: hook time over {steps} optimizer steps\n" + "\n".join(lines)
        if not trainer.is_global_zero:
            return
        print(self.report)
        if self.dirpath is not None and self._checked_dir:  # not after a fit the check itself ended
            os.makedirs(self.dirpath, exist_ok=True)
            f, path = open_new(os.path.join(self.dirpath, self.filename or "simple_profiler.txt"))
            self.report_path = str(path)
            with f:  # an existing file (a user's, an earlier run's report) is kept: -1, -2... instead
                f.write(self.report + "\n")


# the loop's phases: (range name, event that opens it, events that close it)
_PHASES = {
    "on_train_batch_start": ("[loop] training_batch", "[loop] training_step"),
    "on_before_backward": ("[loop] backward",),
    "on_before_optimizer_step": ("[loop] optimizer_step",),
    "on_validation_start": ("[loop] validation",),
}
_CLOSES = {
    "on_before_backward": ("[loop] training_step",),
    "on_after_backward": ("[loop] backward",),
    "on_validation_end": ("[loop] validation",),
    "on_train_batch_end": ("[loop] training_step", "[loop] backward", "[loop] optimizer_step", "[loop] training_batch"),
}


class PyTorchProfiler(HookProfiler):
    """``torch.profiler`` over the fit's training loop: one trace per rank under ``dirpath`` (default
    ``<default_root_dir>/profiler``), named ``<filename>rank<r>.<cycle>.pt.trace.json`` (``trace_handler=
    "chrome"``) or written by torch's TensorBoard handler (``"tensorboard"``, worker ``rank<r>``).

    ``wait``/``warmup``/``active``/``repeat``/``skip_first``: torch.profiler's schedule in training batches
    (or pass ``schedule=torch.profiler.schedule(...)``); none given records every batch. ``repeat`` defaults
    to 1 cycle here (0: cycle until fit ends, torch's default). Each hook runs
    inside ``record_function("<Class>.<hook>")``; the loop's phases are ``[loop] ...`` ranges and, with
    ``record_module_names``, each submodule's forward is ``[module] <path> (<Class>)``.
    At fit end ``summary`` holds ``key_averages().table(sort_by=sort_by_key, row_limit=row_limit)``
    (``group_by_input_shapes`` needs ``record_shapes=True``), also written next to the trace.
    ``profiler_kwargs`` go to ``torch.profiler.profile`` (``activities``, ``record_shapes``,
    ``profile_memory``, ``with_stack``, ``with_flops``, ``with_modules``, ``on_trace_ready``, ``schedule``).
    """

    def __init__(  # noqa: C901 - one validation branch per constructor argument
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        group_by_input_shapes: bool = False,
        emit_nvtx: bool = False,
        export_to_chrome: bool = True,
        row_limit: int = 20,
        record_module_names: bool = True,
        sort_by_key: Optional[str] = None,
        trace_handler: str = "chrome",
        wait: Optional[int] = None,
        warmup: Optional[int] = None,
        active: Optional[int] = None,
        repeat: Optional[int] = None,
        skip_first: Optional[int] = None,
        **profiler_kwargs: Any,
    ) -> None:
        if trace_handler not in TRACE_HANDLERS:
            raise invalid_choice("PyTorchProfiler(trace_handler)", trace_handler, TRACE_HANDLERS)
        if emit_nvtx:
            raise ConfigurationError(
                f"PyTorchProfiler(emit_nvtx={emit_nvtx!r}) is not supported: for Nsight Systems ranges, run under "
                "`nsys profile` with `with torch.autograd.profiler.emit_nvtx():` around trainer.fit yourself"
            )
        known = set(inspect.signature(torch.profiler.profile).parameters)
        unknown = sorted(set(profiler_kwargs) - known)
        if unknown:
            raise ConfigurationError(
                f"PyTorchProfiler got {unknown[0]}={profiler_kwargs[unknown[0]]!r}, which is neither its own argument "
                f"nor torch.profiler.profile's: those are {', '.join(sorted(known))}"
            )
        if sort_by_key is not None and sort_by_key not in SORT_KEYS:
            raise invalid_choice("PyTorchProfiler(sort_by_key)", sort_by_key, SORT_KEYS)
        if not isinstance(row_limit, int) or isinstance(row_limit, bool):
            raise ConfigurationError(f"PyTorchProfiler(row_limit={row_limit!r}) must be an int (-1: every row)")
        for name, value in (("dirpath", dirpath), ("filename", filename)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigurationError(f"PyTorchProfiler({name}={value!r}) must be a path or None")
        if repeat is None and (wait, warmup, active, skip_first) != (None,) * 4:
            repeat = 1  # one cycle (torch's 0 cycles until fit ends, a partial trace at the end included)
        steps = dict(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)
        self._steps = steps
        schedule = profiler_schedule("PyTorchProfiler", **steps)
        if schedule is not None and "schedule" in profiler_kwargs:
            raise ConfigurationError(
                "PyTorchProfiler got both schedule= and wait/warmup/active/repeat/skip_first: pass one of them"
            )
        if "schedule" in profiler_kwargs and not callable(profiler_kwargs["schedule"]):
            raise ConfigurationError(
                f"PyTorchProfiler(schedule={profiler_kwargs['schedule']!r}) must be torch.profiler.schedule(...); "
                "or pass wait=, warmup=, active="
            )
        if group_by_input_shapes:
            profiler_kwargs.setdefault("record_shapes", True)
        profiler_kwargs.setdefault(
            "activities", [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        )
        if schedule is not None:
            profiler_kwargs["schedule"] = schedule
        self.dirpath, self.filename, self.trace_handler = dirpath, filename, trace_handler
        self.group_by_input_shapes, self.export_to_chrome = group_by_input_shapes, export_to_chrome
        self.row_limit, self.sort_by_key = row_limit, sort_by_key
        self.profiler_kwargs = profiler_kwargs
        self.profiler: Optional[torch.profiler.profile] = None
        self.summary = ""
        self.summary_path: Optional[str] = None  # where rank's summary was written (a new file, never over one)
        self.trace_files: List[str] = []
        self._batches = 0  # training batches this fit stepped the profiler through
        self._open: Dict[str, Any] = {}
        if not isinstance(record_module_names, bool):
            raise ConfigurationError(
                f"PyTorchProfiler(record_module_names={record_module_names!r}) must be True or False"
            )
        self.record_module_names = record_module_names
        self._module_ranges: List[Any] = []  # open ranges of the module forwards being run
        self._module_hooks: List[Any] = []

    def wrap(self, name: str, hook: Callable[..., None]) -> Callable[..., None]:
        def recorded(*args: Any) -> None:
            with record_function(name):
                hook(*args)

        return recorded

    # ---- the profiler's life: the training loop of a fit ----------------------------------------------
    def _out_dir(self, trainer: TrainerView) -> str:
        return str(self.dirpath) if self.dirpath is not None else os.path.join(trainer.default_root_dir, "profiler")

    def on_train_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        out, rank = self._out_dir(trainer), trainer.global_rank
        os.makedirs(out, exist_ok=True)
        stem = f"{self.filename}-" if self.filename else ""
        cycles = [0]

        def chrome(prof: torch.profiler.profile) -> None:
            path = os.path.join(out, f"{stem}rank{rank}.{cycles[0]}.pt.trace.json")
            prof.export_chrome_trace(path)
            self.trace_files.append(path)
            cycles[0] += 1

        kwargs = dict(self.profiler_kwargs)
        if "on_trace_ready" not in kwargs and (self.export_to_chrome or self.trace_handler == "tensorboard"):
            tensorboard = tensorboard_trace_handler(out, worker_name=f"{stem}rank{rank}")
            kwargs["on_trace_ready"] = chrome if self.trace_handler == "chrome" else tensorboard
        self.summary, self.trace_files, self._batches = "", [], 0
        self.profiler = torch.profiler.profile(**kwargs)
        if self.record_module_names:
            self._record_modules(module)
        self.profiler.start()

    def _record_modules(self, module: torch.nn.Module) -> None:
        """``[module] <path> (<Class>)`` around each submodule's forward, while this profiler runs."""
        ranges = self._module_ranges

        def hooks(name: str) -> Tuple[Callable[..., None], Callable[..., None]]:
            def enter(*args: Any) -> None:
                ranges.append(record_function(name).__enter__())

            def leave(*args: Any) -> None:
                if ranges:
                    ranges.pop().__exit__(None, None, None)

            return enter, leave

        for path, sub in module.named_modules():
            if path:
                enter, leave = hooks(f"[module] {path} ({type(sub).__name__})")
                self._module_hooks += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]

    def _enter(self, names: tuple) -> None:
        for name in names:
            self._open[name] = record_function(name).__enter__()

    def _exit(self, names: tuple) -> None:
        for name in names:
            ctx = self._open.pop(name, None)
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def on_train_batch_start(self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        if self.profiler is not None:
            self._enter(_PHASES["on_train_batch_start"])

    def on_before_backward(self, trainer: TrainerView, module: TrainingModule, loss: torch.Tensor) -> None:
        if self.profiler is not None:
            self._exit(_CLOSES["on_before_backward"])
            self._enter(_PHASES["on_before_backward"])

    def on_after_backward(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._exit(_CLOSES["on_after_backward"])

    def on_before_optimizer_step(self, trainer: TrainerView, module: TrainingModule, optimizer: Any) -> None:
        if self.profiler is not None:
            self._enter(_PHASES["on_before_optimizer_step"])

    def on_validation_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.profiler is not None:
            self._enter(_PHASES["on_validation_start"])

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._exit(_CLOSES["on_validation_end"])

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._exit(_CLOSES["on_train_batch_end"])
        if self.profiler is not None:
            self.profiler.step()
            self._batches += 1

    def on_train_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._stop(trainer)

    def on_exception(self, trainer: TrainerView, module: TrainingModule, exception: BaseException) -> None:
        self._stop(trainer)

    def _warn_if_nothing_recorded(self, trainer: TrainerView) -> None:
        """A schedule whose first recorded batch comes after the last batch of the fit leaves an empty folder."""
        schedule = self.profiler_kwargs.get("schedule")
        if schedule is None or self.trace_files:
            return
        recording = (torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE)
        if any(schedule(step) in recording for step in range(self._batches)):
            return
        log.warning(
            "trainforge: PyTorchProfiler recorded nothing: its schedule (%s) reaches no active step in the %d "
            "training batches this fit ran, so no trace was written to %s. Lower wait/warmup/skip_first (the "
            "first batch recorded is skip_first + wait + warmup + 1) or train longer",
            self._schedule_text(),
            self._batches,
            self._out_dir(trainer),
        )

    def _schedule_text(self) -> str:
        given = {k: v for k, v in self._steps.items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in given.items()) or "schedule=" + repr(self.profiler_kwargs["schedule"])

    def _stop(self, trainer: TrainerView) -> None:
        self._exit(tuple(reversed(self._open)))
        for handle in self._module_hooks:
            handle.remove()
        while self._module_ranges:  # a forward that raised
            self._module_ranges.pop().__exit__(None, None, None)
        self._module_hooks = []
        prof, self.profiler = self.profiler, None
        if prof is None:
            return
        prof.stop()
        self._warn_if_nothing_recorded(trainer)
        if self.row_limit == 0:
            return
        try:
            averages = prof.key_averages(group_by_input_shape=self.group_by_input_shapes)
        except (AssertionError, RuntimeError):  # nothing was recorded (the schedule never reached active)
            return
        sort_by = self.sort_by_key or ("device_time_total" if torch.cuda.is_available() else "cpu_time_total")
        self.summary = averages.table(sort_by=sort_by, row_limit=self.row_limit)
        stem = f"{self.filename}-" if self.filename else ""
        f, path = open_new(os.path.join(self._out_dir(trainer), f"{stem}rank{trainer.global_rank}-summary.txt"))
        self.summary_path = str(path)
        with f:  # never over an existing file: -1, -2... instead
            f.write(self.summary + "\n")
        if trainer.is_global_zero:
            log.info("PyTorchProfiler summary (rank 0):\n%s", self.summary)
