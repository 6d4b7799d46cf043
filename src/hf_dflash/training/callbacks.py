"""The trainer's callbacks: fresh anchors every epoch, and the real acceptance length measured while training."""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainerCallback


class EpochAnchorsCallback(TrainerCallback):
    """Re-draw the collator's anchors at every epoch."""

    def __init__(self, collator: Any):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(int(state.epoch or 0))


class RealAcceptanceCallback(TrainerCallback):
    """Every `every_n_steps` optimizer steps (and at the end), log the real acceptance length `real_tau`; for a
    DFlash2 drafter also record the selector's per-slot recall@K and teacher-forced accuracy of the last log."""

    def __init__(self, trainer: Trainer, every_n_steps: int):
        """`trainer`: the `DFlashTrainer` to measure (its `measure_real_acceptance`, `training_info` and
        `selector_metrics`)."""
        self.trainer = trainer
        self.every_n_steps = every_n_steps

    def on_train_begin(self, args, state, control, **kwargs):
        # A run resumed from a checkpoint starts with that checkpoint's log history: carry the taus measured before
        # the interruption into the training info (the card's history), as the uninterrupted run has them.
        history = [[entry["step"], round(entry["real_tau"], 3)] for entry in state.log_history if "real_tau" in entry]
        if history:
            self.trainer.training_info.setdefault("training", {})["held_out_tau_by_step"] = history

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self._measure()

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps != 0:
            self._measure()

    def _measure(self) -> None:
        metrics = self.trainer.measure_real_acceptance()
        training = self.trainer.training_info.setdefault("training", {})
        step = self.trainer.state.global_step
        training.setdefault("held_out_tau_by_step", []).append([step, round(metrics["real_tau"], 3)])
        if self.trainer.selector_metrics:
            training.setdefault("selector_by_step", []).append({"step": step, **self.trainer.selector_metrics})
        self.trainer.log(metrics)


__all__ = ["EpochAnchorsCallback", "RealAcceptanceCallback"]
