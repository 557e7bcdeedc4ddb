"""What a checkpoint path is, said plainly before anything opens it: only regular files are read
(a FIFO would block the load forever, a directory fails deep inside a reader with "No such
device"), and a symbolic link that loops or dangles is named as such, not as a missing file."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def path_problem(path: Path) -> str | None:
    """None when path exists (links followed); else why not: "does not exist", "is a symbolic
    link loop", "is a dangling symbolic link (to ...)", or the OS's reason."""
    try:
        os.stat(path)
        return None
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a dangling symbolic link (to {os.readlink(path)!r})"
        return "does not exist"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop"
        return f"cannot be read ({e.strerror})"


def regular_file(path: Path, error: type[Exception], required: bool = True) -> bool:
    """True when path is a regular file (links followed). An absent file: False when not required;
    anything else -- absent but required, a link loop, a directory, a FIFO, a device -- raises
    error naming the path and what it is."""
    problem = path_problem(path)
    if problem == "does not exist" and not required:
        return False
    if problem is not None:
        raise error(f"{path}: {problem}")
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return True
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise error(f"{path}: is {kind}, not a regular file")


def read_json(path: Path, error: type[Exception], required: bool = True, what: str = "a JSON object"):
    """The JSON object in path (None when absent and not required); a broken file, or one that is
    not a regular file, raises error naming it."""
    if not regular_file(path, error, required):
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise error(f"{path}: must hold {what} (a dict), got a {type(raw).__name__}")
    return raw
