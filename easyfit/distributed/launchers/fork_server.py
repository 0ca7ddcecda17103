"""ddp_spawn's fork server ends with its caller (Linux): the server imports this module as it starts (spawn's
PRELOADED) and asks to be killed when the thread that started it ends; `ensure_running` starts it from a thread that
lives as long as the caller. (multiprocessing's own rule, that the server ends once no client holds its "alive" pipe,
fails while its ranks, which hold that pipe too, run on.)"""
from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import forkserver

from easyfit.distributed.launchers.base import variables_set
from easyfit.distributed.launchers.lifetime import die_with_parent

#: the caller's pid, in the server's environment only as it starts
PARENT_VARIABLE = "EASYFIT_FORK_SERVER_PARENT"
_keeper: ThreadPoolExecutor | None = None


def ensure_running() -> None:
    """Start multiprocessing's fork server unless it runs, from the main thread or, when called from another (which
    may end before the process does), from a thread kept for it."""
    global _keeper
    with variables_set({PARENT_VARIABLE: str(os.getpid())}):
        if threading.current_thread() is threading.main_thread():
            forkserver.ensure_running()
            return
        if _keeper is None:
            _keeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="easyfit-fork-server")
        _keeper.submit(forkserver.ensure_running).result()


if os.environ.get(PARENT_VARIABLE):   # in the server as it starts; elsewhere this module does nothing on import
    die_with_parent(int(os.environ.pop(PARENT_VARIABLE)), signal.SIGKILL)
