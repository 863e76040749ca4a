"""Who imported the package first: the user's code, or Lightning loading the callbacks-factory entry point.

Lightning loads ``lightning.pytorch.callbacks_factory`` entry points for every ``Trainer`` in an environment where the
package is installed, which imports the package even in a process that never uses it. Such a ``Trainer`` must not get
this package's callbacks (:func:`lightning_balanced.callbacks.callbacks`), so the first import records its origin.
"""

from __future__ import annotations

import sys

__all__ = ["IMPORTED_BY_LIGHTNING"]


def _imported_for_lightnings_callbacks() -> bool:
    """Whether Lightning's entry-point loader (``_load_external_callbacks``) is on the importing stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_load_external_callbacks":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


#: The package was first imported by Lightning's entry-point loader: no code of this process has used it.
IMPORTED_BY_LIGHTNING: bool = _imported_for_lightnings_callbacks()
