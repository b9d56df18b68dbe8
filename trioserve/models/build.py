"""Building the model a checkpoint's family runs: an encoder (models/bert.py)
or a decoder (models/decoder.py), from the same options."""

from __future__ import annotations

from trioserve.models.checkpoint import Checkpoint
from trioserve.models.family import family_of


def is_encoder(checkpoint: Checkpoint) -> bool:
    return family_of(checkpoint.config.architecture).kind == "encoder"


def build_model(checkpoint: Checkpoint, **options):
    """`EncoderModel` or `DecoderModel` for ``checkpoint``; ``options`` as
    `DecoderModel.from_checkpoint` takes them (an encoder reads the device
    and batch invariance alone: it runs float32 torch operations)."""
    if is_encoder(checkpoint):
        from trioserve.models.bert import EncoderModel  # noqa: PLC0415

        model = EncoderModel.from_checkpoint(checkpoint, device=options.get("device", "cpu"), batch_invariant=options.get("batch_invariant", False))
        model.sep_id = checkpoint.tokenizer.eos_id  # a BERT tokenizer's [SEP] (its end token): where a pair's second text begins
        return model
    from trioserve.models.decoder import DecoderModel  # noqa: PLC0415

    return DecoderModel.from_checkpoint(checkpoint, **options)
