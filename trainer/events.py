"""The lifecycle events of a run, in the order the Trainer fires them.

``Trainer.fit`` is, written as pseudocode (each ``EVENT`` line is one dispatch, first to the
``TrainingModule`` and then to every callback in order)::

    SETUP(stage="fit")
    [LOAD_CHECKPOINT(checkpoint)]                  # when resuming (RNG is restored after FIT_START)
    FIT_START
    [the epoch's end below, if the checkpoint was written at BATCH_END of an epoch's last batch]
    while epochs remain:
        EPOCH_START
        for batch_idx, batch in train_loader:      # resumes mid-epoch at the exact next batch
            BATCH_START(batch, batch_idx)
            loss = module.training_step(batch, batch_idx)     # under autocast
            BEFORE_BACKWARD(loss)
            accelerator.backward(loss)             # gradient sync skipped inside accumulation
            AFTER_BACKWARD
            if this micro-batch completes an accumulation window (or the epoch):
                BEFORE_OPTIMIZER_STEP(optimizer)   # gradients unscaled, not yet clipped
                clip, optimizer.step(), zero_grad(), global_step += 1, scheduler.step() ("step")
                [LOG(metrics, step)]               # every ``log_every_n_steps``
            if validation is due:                  # val_check_interval, check_val_every_n_epoch
                VALIDATION_START
                for each val batch: module.validation_step(...); VALIDATION_BATCH_END(...)
                LOG(validation epoch metrics, step)
                VALIDATION_END                     # monitored checkpoints and early stopping act here
            BATCH_END(outputs, batch, batch_idx)   # step checkpoints are written here
            if trainer.should_stop or max_steps reached: break
        if the epoch ran to its end:
            LOG(training epoch metrics, step)
            scheduler.step() ("epoch")
            EPOCH_END                              # epoch checkpoints are written here
    FIT_END
    TEARDOWN(stage="fit")

    SAVE_CHECKPOINT(checkpoint) fires inside any of the above whenever a checkpoint is written,
    before the files are, so callbacks and the module can add to ``checkpoint["extra"]``.
    Validation runs before BATCH_END so that a checkpoint written there already includes it: a
    resumed run replays nothing and skips nothing.

    any exception inside the above:  EXCEPTION(exception), TEARDOWN, then the exception is re-raised.

``validate``/``test`` fire SETUP, VALIDATION_START, VALIDATION_BATCH_END per batch, LOG,
VALIDATION_END and TEARDOWN with ``trainer.stage`` set to "validate" or "test"; ``predict`` fires
SETUP and TEARDOWN only.
"""
from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """One lifecycle event. The value is the name of the hook method that receives it."""

    SETUP = "on_setup"
    FIT_START = "on_fit_start"
    EPOCH_START = "on_train_epoch_start"
    BATCH_START = "on_train_batch_start"
    BEFORE_BACKWARD = "on_before_backward"
    AFTER_BACKWARD = "on_after_backward"
    BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    BATCH_END = "on_train_batch_end"
    EPOCH_END = "on_train_epoch_end"
    VALIDATION_START = "on_validation_start"
    VALIDATION_BATCH_END = "on_validation_batch_end"
    VALIDATION_END = "on_validation_end"
    LOG = "on_log"
    SAVE_CHECKPOINT = "on_save_checkpoint"
    LOAD_CHECKPOINT = "on_load_checkpoint"
    FIT_END = "on_fit_end"
    EXCEPTION = "on_exception"
    TEARDOWN = "on_teardown"
