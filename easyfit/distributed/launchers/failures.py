"""What went wrong in a rank, and which of several failures caused the others."""
from __future__ import annotations

import os
import signal


class RankFailedError(RuntimeError):
    """A rank raised or died; carries the rank and the original traceback text."""

    def __init__(self, rank: int, details: str):
        self.rank, self.details = rank, details
        super().__init__(f"rank {rank} failed; all ranks were stopped. Its error:\n\n{details}")


def looks_like_peer_error(text: str) -> bool:
    """Errors that a collective raises when a peer went away: consequences, not causes."""
    text = text.lower()
    return any(word in text for word in ("connection closed", "connection reset", "connection refused",
                                         "reset by peer", "broken pipe", "gloo", "nccl", "timed out"))


def read_error_file(error_file: str | None) -> str:
    if error_file and os.path.exists(error_file):
        with open(error_file, encoding="utf-8", errors="replace") as file:
            return file.read().strip()
    return ""


def rank_failure(rank: int, exitcode: int | None, error_file: str | None) -> RankFailedError | None:
    """What went wrong in a finished rank, from its exit code and the traceback it wrote; None if it succeeded."""
    if exitcode in (None, 0):
        return None
    details = read_error_file(error_file)
    if exitcode < 0:
        details = details or f"killed by signal {signal.Signals(-exitcode).name}"
    return RankFailedError(rank, details or f"exited with code {exitcode} (see its output above)")


def root_cause(failures: list[RankFailedError]) -> RankFailedError | None:
    """The failure that caused the others: not a lost peer connection, not the SIGTERM sent to stop a rank."""
    causes = [f for f in failures if not looks_like_peer_error(f.details) and "SIGTERM" not in f.details]
    return (causes or failures or [None])[0]
