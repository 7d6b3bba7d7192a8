"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn`: the kernel sends the child SIGTERM when its parent dies, however the parent dies.

    The child also gets its own session, so a terminal's Ctrl-C reaches only the parent, which then stops its
    children in a chosen order.
    """
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setsid()
