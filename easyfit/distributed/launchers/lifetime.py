"""How long started processes live: no rank outlives the process that started it, and SIGTERM (how a job scheduler
ends a job) lets a process clean up before it ends as the signal would have ended it.

Linux only where it says so: `PR_SET_PDEATHSIG` has no equivalent on macOS or Windows."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1


class Terminated(BaseException):
    """Raised by SIGTERM inside `cleaned_up_on_sigterm`, so that the code it interrupts cleans up on its way out."""


def die_with_parent(parent: int | None = None, signal_number: int = signal.SIGTERM) -> None:
    """In a child: receive `signal_number` when the parent *thread* that started it ends (Linux); `parent`, the pid
    expected as the parent, ends the child at once if that parent has already gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal_number)
    except OSError:   # not Linux
        return
    if parent is not None and os.getppid() != parent:   # it died before prctl, which then fires no signal
        os.kill(os.getpid(), signal_number)


@contextlib.contextmanager
def cleaned_up_on_sigterm(grace: float | None = None) -> Iterator[None]:
    """In the main thread: SIGTERM raises `Terminated` inside the block, whose `finally` clauses and `except
    BaseException` handlers then run (an atomic write removes its temporary file); after them the process ends as
    SIGTERM would have ended it, or the handler there was before runs. With `grace`, a process whose main thread
    does not come back from native code (a collective waiting for a peer) within `grace` seconds of the signal ends
    by SIGTERM's default action then. Elsewhere (another thread, SIGTERM ignored or handled outside Python) the
    block runs as it is."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return

    def raise_terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second SIGTERM does not interrupt the clean-up
        raise Terminated

    signal.signal(signal.SIGTERM, raise_terminated)
    wakeup = _end_after_sigterm(grace) if grace is not None else None
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)   # by default the process ends here
        raise   # the previous handler returned
    finally:
        signal.signal(signal.SIGTERM, previous)
        if wakeup is not None:
            signal.set_wakeup_fd(wakeup)


def _end_after_sigterm(grace: float) -> int:
    """Start a thread that ends this process by SIGTERM's default action `grace` seconds after it receives SIGTERM;
    the wakeup fd there was. Python runs a signal handler only when its main thread runs Python code; the C level
    writes each signal's number to the wakeup fd at once."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=_as_before)

    def watch() -> None:
        while int(signal.SIGTERM) not in os.read(read_end, 64):
            pass
        time.sleep(grace)
        libc = ctypes.CDLL(None)   # signal.signal works in the main thread only
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)   # the exit status says SIGTERM, as a rank stopped by it
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="easyfit-sigterm-grace", daemon=True).start()
    return previous


def _as_before() -> None:
    """In a child forked from here (a DataLoader worker): its signals are its own, SIGTERM ends it at once."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
