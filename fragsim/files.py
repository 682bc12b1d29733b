"""Writing files so that a reader never sees half of one.

Every file fragsim writes (results, study tables, figures, traces, snapshot
reports) goes through :func:`write_atomically`: the bytes go to a temporary file
in the target's directory, which is then renamed over the target. A crash or a
full disk leaves the old file (or none), never a truncated one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fragsim.errors import FragsimError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any],
                     what: str = "") -> None:
    """Call ``write`` on a binary file that becomes ``path`` only once it is whole.

    An unwritable target is a :class:`FragsimError` naming it (``what``, e.g.
    ``"the plot"``, says what could not be written)."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    label = f"{target}: cannot write{f' {what}' if what else ''}"
    if not directory.is_dir():
        raise FragsimError(f"{label}: no directory {directory}")
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise FragsimError(f"{label}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise FragsimError(f"{label}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
