"""The weights' loading bar the commands that load a model draw on stderr."""

from __future__ import annotations

import sys


def progress_bar(done: int, total: int) -> None:
    if not sys.stderr.isatty() and done != total:
        return  # only the final state when stderr is a log file
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\rloading weights [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()
