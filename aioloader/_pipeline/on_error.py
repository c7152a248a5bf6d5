"""The error policy of one epoch: whether a sample that failed in a user callable may be dropped.

With `on_error="raise"`, an error in a user callable ends the epoch: batches before it (in delivery
order) are delivered, then the error is raised to the consumer with a note naming the stage and the
key. With `on_error="skip"` the sample is dropped from its batch and counted, until `max_skipped`.
With `batch_errors` (torch's DataLoader), an error ends its batch only: its place is handed over as
a `BatchFailed`, whose error the consumer's `next()` raises, and the epoch goes on.

The count against `max_skipped` is kept here alone, and in the order batches go out (`settle`):
which fault spends the budget does not depend on which decode ended first. What a failure does to
its batch (drop the sample, fail the batch, end the epoch) is the assembler's to carry out
(`assemble.py`), as this policy answers.
"""

from __future__ import annotations

from typing import Any

from .inline import note_error
from .reorder import Item
from .stages import Stages

__all__ = ["OnError"]


class OnError:
    """The epoch's answers to "may this failed sample be dropped?", and its count of those dropped.

    Called on the epoch's loop only; nothing here blocks.
    """

    def __init__(self, stages: Stages, epoch_samples: int | None) -> None:
        self._policy = stages.errors
        self._rec = stages.recorder
        self._epoch_samples = epoch_samples  # what a fractional `max_skipped` is a share of
        self._skipped = 0
        self.batch_errors = stages.batch_errors  # an error ends its batch, not the epoch

    def skips_later(self, exc: BaseException) -> bool:
        """Whether `exc` drops its sample now, to be counted as its batch goes out (`settle`):
        under `on_error="skip"`, an `Exception` (SystemExit & co. belong to the consumer)."""
        return self._policy.on_error == "skip" and isinstance(exc, Exception)

    def skip(self, exc: BaseException, stage: str, keys: list[Any]) -> bool:
        """Count `keys` as skipped if the policy allows it; False: `exc` must end the epoch (or,
        with `batch_errors`, its batch), and carries a note when `max_skipped` is what is spent."""
        policy = self._policy
        self._skipped += len(keys)
        if isinstance(exc, Exception) and policy.allows(self._skipped, self._epoch_samples):
            for key in keys:
                self._rec.skip(stage, key, f"{type(exc).__name__}: {exc}")
            return True
        if policy.on_error == "skip":
            exc.add_note(
                f"aioloader: on_error='skip' but max_skipped={policy.max_skipped} is spent"
            )
        return False

    def settle(self, item: Item) -> Item:
        """`item` as it goes out in order: its skipped samples counted, and in its place the error
        of the first of them past `max_skipped` (the reorder calls this, `reorder.py`)."""
        for stage, key, exc in item.faults:
            if not self.skip(exc, stage, [key]):
                if item.error is None:
                    self._rec.unmade()  # (counted as made; the consumer gets the error instead)
                return item._replace(batch=None, error=note_error(exc, stage, [key]), faults=())
        return item
