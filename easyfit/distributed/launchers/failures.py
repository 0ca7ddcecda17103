"""What went wrong in a rank, and which of several failures caused the others."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile


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
    """What went wrong in a rank, from its exit code and the traceback it wrote when a call raised (even if the
    script caught the error and went on, or exited with code 0); None if nothing did."""
    details = read_error_file(error_file)
    if exitcode in (None, 0) and not details:
        return None
    if exitcode is not None and exitcode < 0:
        details = details or f"killed by signal {signal.Signals(-exitcode).name}"
    return RankFailedError(rank, details or f"exited with code {exitcode} (see its output above)")


def exchange_directory(kind: str) -> str:
    """A new folder where ranks leave their tracebacks and results, named after this process; folders that a killed
    caller left behind (their process is gone) are removed first."""
    for name in os.listdir(tempfile.gettempdir()):
        parts = name.split("-")
        if name.startswith("easyfit-") and len(parts) > 2 and parts[2].isdigit() and not _alive(int(parts[2])):
            shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"easyfit-{kind}-{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stuck_ranks(failure: RankFailedError | None, alive: list[int]) -> RankFailedError | None:
    """When a rank timed out waiting for its peers while others were still running, the ones still running are
    the cause: stuck, or far slower than the rest. None when that is not what happened."""
    if failure is None or not alive or "timed out" not in failure.details.lower():
        return None
    ranks = ", ".join(str(rank) for rank in alive)
    return RankFailedError(alive[0], f"rank(s) {ranks} did not reach a collective in time: rank {failure.rank} "
                                     f"timed out waiting for them while they were still running (stuck, or much "
                                     f"slower than the others). Rank {failure.rank}'s error:\n{failure.details}")


def root_cause(failures: list[RankFailedError]) -> RankFailedError | None:
    """The failure that caused the others: not a lost peer connection, not the SIGTERM sent to stop a rank; a rank's
    own traceback before a rank that died by a signal (a collective library aborts when its peer went away)."""
    causes = [f for f in failures if not looks_like_peer_error(f.details) and "SIGTERM" not in f.details]
    raised = [f for f in causes if not f.details.startswith("killed by signal")]
    return (raised or causes or failures or [None])[0]
