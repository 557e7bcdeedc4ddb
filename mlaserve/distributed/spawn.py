"""How rank 0 starts a worker on one machine: a fresh `python` running `main` below, an
interpreter that imports only mlaserve -- never the caller's main module (multiprocessing's spawn
and forkserver re-run it, which fails from `python -`, a notebook, or a script without a
`__main__` guard). The WorkerSpec travels pickled over the worker's stdin, which then stays open:
its end of file (rank 0 exited, however) ends the worker. The worker's stderr is relayed to
rank 0's stderr line by line and its tail kept, so a worker that dies before it can leave a
report in the store is named with its own last words."""

from __future__ import annotations

import collections
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

# The worker's first lines: drop sys.path[0] (the current directory, where a module could shadow
# ours; `python -P` does this from 3.11 only), then run main below.
_BOOT = "import sys; del sys.path[0]; from mlaserve.distributed.spawn import main; main()"
STDERR_TAIL_LINES = 20  # the worker's last stderr lines kept for an error message

_live: weakref.WeakSet = weakref.WeakSet()


class WorkerProcess:
    """A started worker, with the parts of multiprocessing.Process rank 0 uses (pid, is_alive,
    join, terminate, kill, exitcode: negative for a signal) and the tail of its stderr."""

    def __init__(self, spec, name: str) -> None:
        self.name = name
        package_root = str(Path(__file__).resolve().parents[2])  # this copy of mlaserve, whatever sys.path says
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._popen = subprocess.Popen(
            [sys.executable, "-c", _BOOT],
            stdin=subprocess.PIPE,
            stdout=None,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal is rank 0's to handle, not the workers'
        )
        self.pid = self._popen.pid
        self._relay = threading.Thread(target=self._relay_stderr, name=f"{name}-stderr", daemon=True)
        self._relay.start()
        try:
            data = pickle.dumps(spec)
            self._popen.stdin.write(len(data).to_bytes(8, "little") + data)
            self._popen.stdin.flush()
        except OSError:
            pass  # it died at once: is_alive() and stderr_tail() say how
        _live.add(self)

    def _relay_stderr(self) -> None:
        for raw in iter(self._popen.stderr.readline, b""):
            line = raw.decode(errors="replace")
            self._tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):
                pass

    def stderr_tail(self) -> str:
        """The worker's last stderr lines (all of them once it has exited and the pipe drained)."""
        if self._popen.poll() is not None:
            self._relay.join(2.0)
        return "\n".join(self._tail)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        self._close_stdin()

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._popen.poll() is None:
            try:
                self._popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def _close_stdin(self) -> None:
        try:
            self._popen.stdin.close()
        except OSError:
            pass


def live_workers() -> list[WorkerProcess]:
    """Workers this process started that are still running."""
    return [w for w in list(_live) if w.is_alive()]


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("rank 0 closed the worker's stdin before sending its spec")
        data += chunk
    return data


def _exit_when_parent_leaves(fd: int) -> None:
    while os.read(fd, 65536):  # the raw descriptor: a buffered reader's lock would block finalization
        pass
    os._exit(1)  # rank 0 is gone: nothing is left to serve


def main() -> None:
    stdin = sys.stdin.fileno()
    spec = pickle.loads(_read_exactly(stdin, int.from_bytes(_read_exactly(stdin, 8), "little")))
    threading.Thread(target=_exit_when_parent_leaves, args=(stdin,), name="parent-watch", daemon=True).start()
    from mlaserve.distributed.worker import worker_main

    worker_main(spec)
