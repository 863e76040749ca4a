"""Log lines that do not land inside a progress bar's line.

Lightning's ``TQDMProgressBar`` redraws its bar in place; a log line written meanwhile (a split plan on the first
batch, the learning-rate scaling at ``on_train_start``, once the bar exists) starts in the middle of the bar's line.
:func:`rank_zero_report` logs as ``rank_zero_info`` does, inside tqdm's ``external_write_mode``: every bar is cleared
first and redrawn after, as ``tqdm.write`` does for prints.
"""

from __future__ import annotations

import sys

from lightning.pytorch.utilities import rank_zero_info

__all__ = ["counted", "rank_zero_report"]


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """``"1 sample"``, ``"3 samples"``, ``"2 micro-batches"``: a count and its noun in the right number.

    Args:
        number: the count.
        noun: the singular.
        plural: the plural, when it is not ``noun + "s"``.
    """
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def rank_zero_report(message: str) -> None:
    """``rank_zero_info(message)`` with any tqdm progress bar cleared around it (rank 0 only, as Lightning logs)."""
    try:
        from tqdm import tqdm
    except ImportError:  # Lightning's progress bar needs tqdm; without it there is no bar to clear
        rank_zero_info(message)
        return
    with tqdm.external_write_mode(file=sys.stderr):
        rank_zero_info(message)
