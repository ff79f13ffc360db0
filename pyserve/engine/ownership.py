"""State that one thread owns, and a check that no other thread touches it.

An object derived from `ThreadOwned` may be built on any thread; once a
thread claims it, that thread alone reads and writes it. The engine uses
this for what the forward thread keeps (the sampler and each request's
sampling state): the event loop builds it, hands it over through the
forward thread's queue, and never touches it again.

The check hooks every attribute access, so it is off unless
`check_thread_ownership` turns it on (the tests do). It records each
access from a thread that does not own the object in `violations`, with
the line that made it, and lets the access go on: raising instead would
leave the engine half way through ending a request, and an exception on
a worker thread may go unseen.
"""

from __future__ import annotations

import sys
import threading

# What the check found while on: one line per access from a thread that
# does not own the object.
violations: list[str] = []


class ThreadOwned:
    # The claiming thread; None until claimed. The thread itself, not its
    # ident: a thread started after the owner ended may get the same ident.
    _owner: threading.Thread | None = None

    def claim(self) -> None:
        """The calling thread owns this object from now on."""
        object.__setattr__(self, "_owner", threading.current_thread())


def _check(obj: ThreadOwned, name: str, action: str) -> None:
    if name.startswith("__"):  # repr, class and dict lookups of the runtime and of debuggers
        return
    owner = object.__getattribute__(obj, "_owner")
    if owner is not None and owner is not threading.current_thread():
        caller = sys._getframe(2)  # the code that made the access, past the hook
        violations.append(f"thread {threading.current_thread().name!r} {action} {type(obj).__name__}.{name} "
                          f"at {caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name}), "
                          "but another thread owns it")


def _checked_getattribute(self: ThreadOwned, name: str):
    _check(self, name, "read")
    return object.__getattribute__(self, name)


def _checked_setattr(self: ThreadOwned, name: str, value) -> None:
    _check(self, name, "wrote")
    object.__setattr__(self, name, value)


def check_thread_ownership(on: bool = True) -> None:
    """Turn the check on (or off) for every ThreadOwned object."""
    if on:
        ThreadOwned.__getattribute__ = _checked_getattribute
        ThreadOwned.__setattr__ = _checked_setattr
    elif "__setattr__" in ThreadOwned.__dict__:
        del ThreadOwned.__getattribute__
        del ThreadOwned.__setattr__
