"""What a copy medium returns for a copy it started (:class:`Pending`); :data:`DONE` for one
that completed when it was issued (the CPU medium). Used by the mover and its media."""
from __future__ import annotations

from typing import Protocol


class Pending(Protocol):
    """A copy a medium started; ``wait()`` returns once its bytes arrived; ``landed()`` says
    whether they did, without waiting."""

    def wait(self) -> None: ...

    def landed(self) -> bool: ...


class Done:
    """A copy that completed when it was issued (the CPU medium)."""

    def wait(self) -> None:
        pass

    def landed(self) -> bool:
        return True


DONE = Done()
