"""Hugging Face integration: ``spdsl.hf.sequence_parallel(trainer, seq=N)`` turns a
``transformers.Trainer`` (or TRL's ``SFTTrainer``) into exact sequence-parallel training.

Importing this module does not import ``transformers``.

Example::

    trainer = spdsl.hf.sequence_parallel(Trainer(model=model, args=args, ...), seq=4)
    trainer.train()
"""

from spdsl.hf.pad import pad_batch
from spdsl.hf.trainer import sequence_parallel

__all__ = ["pad_batch", "sequence_parallel"]
