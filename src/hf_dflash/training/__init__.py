"""Training a drafter: `DFlashTrainingArguments` + `DFlashTrainer` (a `transformers.Trainer`), the loss, the collator
that cuts blocks, the target features, the drafter's initialisation (from the target, or DFlash2 from a v1 drafter),
and the `train` command's script."""

from .arguments import DFlashTrainingArguments
from .trainer import DFlashTrainer

__all__ = ["DFlashTrainer", "DFlashTrainingArguments"]
