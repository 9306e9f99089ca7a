"""What each client got, kept on the gateway's own disk: the ledger bills the tokens a client received, and only the
gateway knows that number. Redis may be down when a response ends short, and the gateway itself may die with
streams open (its clients' connections die with it), so every request the gateway relays is journaled here, each
delivered chunk too, until its outcome is safely in Redis. A gateway that starts takes over the journals of gateways
that died on this host (or volume) and ends their open requests for their clients, with the counts they got.

A journal is an append-only text file of lines `o RID` (relaying), `d RID N` (N completion tokens delivered so far),
`c RID` (nothing more owed), beside a lock file that its gateway holds (flock) while it lives. Written with plain
`write` calls: what a killed process wrote is in the file (the page cache outlives it); a host crash may lose the
last lines, as it loses the gateway's connections. A chunk's line follows its socket write, so a kill between the two
bills its client one chunk less, never one more."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

COMPACT_BYTES = 4 << 20  # rewrite the file with only the open requests past this size


class DeliveryJournal:
    def __init__(self, directory: Path, slot: int, lock_fd: int, inherited: dict[str, int]):
        self.directory, self.slot, self._lock_fd = directory, slot, lock_fd
        self.path = directory / f"journal-{slot}.log"
        self.inherited = inherited  # what dead gateways' journals owe (see `take`)
        self._open = dict(inherited)  # request id -> tokens delivered
        self._fd = -1
        self._failed = False
        self._rewrite()

    @classmethod
    def take(cls, directory: Path) -> DeliveryJournal:
        """The first journal slot in `directory` no live gateway holds, with what the dead gateways' journals owe
        as its `inherited`: request id -> tokens its client got, for every request they did not close. Those
        journals are consumed: their requests are open in the new one until the caller closes them."""
        directory.mkdir(parents=True, exist_ok=True)
        owed: dict[str, int] = {}
        dead: list[tuple[int, int]] = []  # (slot, its lock), for every slot no live gateway holds
        for slot in range(_slots(directory) + 1):
            if (lock_fd := _try_lock(directory / f"journal-{slot}.lock")) is not None:
                owed.update(_owed(directory / f"journal-{slot}.log"))
                dead.append((slot, lock_fd))
        (slot, lock_fd), *others = dead
        journal = cls(directory, slot, lock_fd, owed)
        for other, other_lock in others:  # only once what they owe is in ours
            (directory / f"journal-{other}.log").unlink(missing_ok=True)
            os.close(other_lock)
        return journal

    def opened(self, request_id: str) -> None:
        self._open[request_id] = 0
        self._write(f"o {request_id}\n")

    def delivered(self, request_id: str, tokens: int) -> None:
        """`tokens`: completion tokens delivered so far (the total, not the increment)."""
        if request_id in self._open:
            self._open[request_id] = tokens
            self._write(f"d {request_id} {tokens}\n")

    def closed(self, request_id: str) -> None:
        if self._open.pop(request_id, None) is not None:
            self._write(f"c {request_id}\n")
            if not self._open:  # nothing in it is owed any more
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)
            elif os.fstat(self._fd).st_size > COMPACT_BYTES:
                self._rewrite()

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._lock_fd)

    def _write(self, line: str) -> None:
        try:
            os.write(self._fd, line.encode())
        except OSError as exc:  # a full disk costs the crash-safety of the counts, never a client's response
            if not self._failed:
                log.error("the delivery journal %s cannot be written (%s): a crash of this gateway now may bill "
                          "tokens its clients did not get", self.path, exc)
            self._failed = True

    def _rewrite(self) -> None:
        """The open requests alone, in a new file that replaces the old one whole."""
        staging = self.path.with_suffix(".staging")
        staging.write_text("".join(f"o {rid}\nd {rid} {n}\n" for rid, n in self._open.items()))
        staging.replace(self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)


class UnjournaledDeliveries:
    """For a gateway run in process without a journal directory (tests, benchmarks): nothing outlives it."""

    @property
    def inherited(self) -> dict[str, int]:
        return {}

    def opened(self, request_id: str) -> None:
        pass

    def delivered(self, request_id: str, tokens: int) -> None:
        pass

    def closed(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def open_journal(directory: Path) -> DeliveryJournal | UnjournaledDeliveries:
    """The gateway's journal in `directory`; where it cannot be written, the gateway serves without one, and says
    so once at its start."""
    try:
        return DeliveryJournal.take(directory)
    except OSError as exc:
        log.error("no delivery journal (%s): a crash of this gateway will bill its open streams' clients for every "
                  "token generated, not the ones they got; set TOKENFLEET_GATEWAY_JOURNAL_DIR to a writable directory",
                  exc)
        return UnjournaledDeliveries()


def _slots(directory: Path) -> int:
    numbers = [int(path.stem.removeprefix("journal-")) for path in directory.glob("journal-*.lock")
               if path.stem.removeprefix("journal-").isdigit()]
    return max(numbers, default=-1) + 1


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _owed(path: Path) -> dict[str, int]:
    """The requests a journal left open, with the tokens their clients got (a torn last line is skipped)."""
    owed: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError), path.open() as lines:
        for line in lines:
            match line.split():
                case ["o", request_id]:
                    owed[request_id] = 0
                case ["d", request_id, tokens] if request_id in owed and tokens.isdigit():
                    owed[request_id] = int(tokens)
                case ["c", request_id]:
                    owed.pop(request_id, None)
    return owed
