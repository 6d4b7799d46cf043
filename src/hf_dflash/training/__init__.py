"""Training a drafter: `DFlashTrainingArguments` + `DFlashTrainer` (a `transformers.Trainer`), the collator that
cuts blocks, the target features, the drafter's initialisation from the target, and the `train` command's script."""

from .trainer import DFlashTrainer, DFlashTrainingArguments

__all__ = ["DFlashTrainer", "DFlashTrainingArguments"]
