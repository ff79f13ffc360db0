"""State that one thread owns, and a check that no other thread touches it.

An object derived from `ThreadOwned` may be built on any thread; once a
thread claims it, that thread alone reads and writes it. The engine uses
this for what the forward thread keeps (the sampler and each request's
sampling state): the event loop builds it, hands it over through the
forward thread's queue, and never touches it again.

The check hooks every attribute access, so it is off unless
`check_thread_ownership` turns it on (the tests do). A violation raises
OwnershipError on the offending thread and is also kept in `violations`,
since an exception raised on a worker thread may go unseen.
"""

from __future__ import annotations

import threading

# What the check found while on: one line per access from a thread that
# does not own the object.
violations: list[str] = []


class OwnershipError(RuntimeError):
    pass


class ThreadOwned:
    _owner: int | None = None  # the claiming thread's ident; None until claimed

    def claim(self) -> None:
        """The calling thread owns this object from now on."""
        object.__setattr__(self, "_owner", threading.get_ident())


def _check(obj: ThreadOwned, name: str, action: str) -> None:
    if name.startswith("__"):  # repr, class and dict lookups of the runtime and of debuggers
        return
    owner = object.__getattribute__(obj, "_owner")
    if owner is not None and owner != threading.get_ident():
        message = (f"thread {threading.current_thread().name!r} {action} {type(obj).__name__}.{name}, "
                   f"which belongs to another thread")
        violations.append(message)
        raise OwnershipError(message)


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
