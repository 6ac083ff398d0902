"""The lifecycle events of a run, in the order the Trainer fires them.

``Trainer.fit`` is, written as pseudocode (each ``EVENT`` line is one dispatch in Lightning 2.6's order:
the callbacks in their order, then the ``TrainingModule``; at LOAD_CHECKPOINT the module first; the
monitoring callbacks, ``Callback.monitors_metrics``: checkpointing and early stopping, always after the
module)::

    SETUP(stage="fit")
    [LOAD_CHECKPOINT(checkpoint)]                  # when resuming (RNG is restored after TRAIN_START)
    FIT_START
    [SANITY_CHECK_START, a validation of num_sanity_val_steps batches (metrics dropped), SANITY_CHECK_END]
    TRAIN_START
    [the epoch's end below, if the checkpoint was written at BATCH_END of an epoch's last batch]
    while epochs remain:
        EPOCH_START
        for batch_idx, batch in train_loader:      # resumes mid-epoch at the exact next batch
            BATCH_START(batch, batch_idx)
            loss = module.training_step(batch, batch_idx)     # under autocast
            [BEFORE_ZERO_GRAD(optimizer), module.optimizer_zero_grad(...)]   # a window's first batch
            BEFORE_BACKWARD(loss)
            accelerator.backward(loss)             # gradient sync skipped inside accumulation
            AFTER_BACKWARD
            if this micro-batch completes an accumulation window (or the epoch):
                BEFORE_OPTIMIZER_STEP(optimizer)   # gradients unscaled, not yet clipped
                clip, optimizer.step(), global_step += 1, scheduler.step() ("step")
                (a module overriding optimizer_step runs the lines from training_step to here through its
                optimizer_closure and optimizer.step: trainer/loop/step_hooks.py)
                [LOG(metrics, step)]               # every ``log_every_n_steps``
            if validation is due:                  # val_check_interval, check_val_every_n_epoch
                VALIDATION_START, VALIDATION_EPOCH_START
                for each val batch: VALIDATION_BATCH_START(batch, batch_idx); module.validation_step(...);
                                    VALIDATION_BATCH_END(outputs, batch, batch_idx)
                (several loaders: dataloader_idx follows batch_idx in the step and both events)
                VALIDATION_EPOCH_END               # the epoch's values are in callback_metrics
                LOG(validation epoch metrics and what VALIDATION_EPOCH_END logged, step)   # one row (Lightning)
                VALIDATION_END                     # monitored checkpoints and early stopping act here
            BATCH_END(outputs, batch, batch_idx)   # step checkpoints are written here
            [the validation above, if trainer.should_stop may be obeyed, this epoch validates and it did not run]
            if trainer.should_stop (min_epochs/min_steps met) or max_steps reached: break
        if the epoch ran to its end or trainer.should_stop ended it (Lightning; not max_steps):
            scheduler.step() ("epoch")
            EPOCH_END                              # epoch checkpoints are written here
            LOG(training epoch metrics and what EPOCH_END logged, step)   # one row (Lightning)
    TRAIN_END
    FIT_END
    TEARDOWN(stage="fit")

    SAVE_CHECKPOINT(checkpoint) fires inside any of the above whenever a checkpoint is written,
    before the files are, so callbacks and the module can add to ``checkpoint["extra"]``.
    Validation runs before BATCH_END so that a checkpoint written there already includes it: a
    resumed run replays nothing and skips nothing.

    any exception inside the above:  EXCEPTION(exception), TEARDOWN, then the exception is re-raised.

``validate`` fires SETUP, the validation events above and TEARDOWN with ``trainer.stage`` set to
"validate"; ``test`` and ``predict`` fire the same shape with their own events (TEST_START ...
TEST_END, PREDICT_START ... PREDICT_END; see ``EVAL_EVENTS``).

The module's hooks are Lightning's: the same names with Lightning's signatures (no ``trainer,
module`` arguments; SETUP and TEARDOWN are ``setup(stage)``/``teardown(stage)``), see
``trainer/loop/module_hooks.py``; callbacks take ``(trainer, module, ...)``.
"""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """One lifecycle event. The value is the name of the hook method that receives it."""

    SETUP = "on_setup"
    FIT_START = "on_fit_start"
    SANITY_CHECK_START = "on_sanity_check_start"
    SANITY_CHECK_END = "on_sanity_check_end"
    TRAIN_START = "on_train_start"
    EPOCH_START = "on_train_epoch_start"
    BATCH_START = "on_train_batch_start"
    BEFORE_BACKWARD = "on_before_backward"
    AFTER_BACKWARD = "on_after_backward"
    BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    BEFORE_ZERO_GRAD = "on_before_zero_grad"
    BATCH_END = "on_train_batch_end"
    EPOCH_END = "on_train_epoch_end"
    TRAIN_END = "on_train_end"
    VALIDATION_START = "on_validation_start"
    VALIDATION_EPOCH_START = "on_validation_epoch_start"
    VALIDATION_BATCH_START = "on_validation_batch_start"
    VALIDATION_BATCH_END = "on_validation_batch_end"
    VALIDATION_EPOCH_END = "on_validation_epoch_end"
    VALIDATION_END = "on_validation_end"
    TEST_START = "on_test_start"
    TEST_EPOCH_START = "on_test_epoch_start"
    TEST_BATCH_START = "on_test_batch_start"
    TEST_BATCH_END = "on_test_batch_end"
    TEST_EPOCH_END = "on_test_epoch_end"
    TEST_END = "on_test_end"
    PREDICT_START = "on_predict_start"
    PREDICT_EPOCH_START = "on_predict_epoch_start"
    PREDICT_BATCH_START = "on_predict_batch_start"
    PREDICT_BATCH_END = "on_predict_batch_end"
    PREDICT_EPOCH_END = "on_predict_epoch_end"
    PREDICT_END = "on_predict_end"
    LOG = "on_log"
    SAVE_CHECKPOINT = "on_save_checkpoint"
    LOAD_CHECKPOINT = "on_load_checkpoint"
    FIT_END = "on_fit_end"
    EXCEPTION = "on_exception"
    TEARDOWN = "on_teardown"


#: The events of one evaluation loop, per step method: start, epoch start, batch start, batch end,
#: epoch end, end (Lightning's on_validation_*/on_test_*/on_predict_* hooks).
EVAL_EVENTS = {
    "validation_step": (
        Event.VALIDATION_START,
        Event.VALIDATION_EPOCH_START,
        Event.VALIDATION_BATCH_START,
        Event.VALIDATION_BATCH_END,
        Event.VALIDATION_EPOCH_END,
        Event.VALIDATION_END,
    ),
    "test_step": (
        Event.TEST_START,
        Event.TEST_EPOCH_START,
        Event.TEST_BATCH_START,
        Event.TEST_BATCH_END,
        Event.TEST_EPOCH_END,
        Event.TEST_END,
    ),
    "predict_step": (
        Event.PREDICT_START,
        Event.PREDICT_EPOCH_START,
        Event.PREDICT_BATCH_START,
        Event.PREDICT_BATCH_END,
        Event.PREDICT_EPOCH_END,
        Event.PREDICT_END,
    ),
}
