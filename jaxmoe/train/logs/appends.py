"""Appending to a run's log files whole: each record is on disk entirely or not at all.

A run's logs are read while it trains and after it stopped, whatever stopped it. A write
that fails part way (a full disk) would leave half a record for every reader to trip
over, so the file is cut back to where it ended and the error raised: the loop then stops
the run with ``exit_codes.IO_ERROR``, and every record in the file is whole.
"""

from __future__ import annotations

import errno
import os


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the file open at ``fd`` in one write; on a failed or short write
    the file is cut back to its previous end and OSError is raised."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a short write: disk full
    except OSError:
        os.ftruncate(fd, end)
        raise
