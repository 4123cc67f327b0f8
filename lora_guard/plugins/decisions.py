"""What the deciding hooks may return."""

from __future__ import annotations

from dataclasses import dataclass


class BusyRetry(Exception):
    """The request cannot be served now; the client should retry after ``retry_after`` seconds.

    The server answers HTTP 429 with TGI's ``overloaded`` error and a ``Retry-After`` header.
    """

    def __init__(self, message: str, retry_after: float) -> None:
        if retry_after <= 0:
            raise ValueError("retry_after must be positive")
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Load:
    """Go ahead: read a cold adapter from disk, or put a warm one into ``slot`` (evicting what is
    there, if no request holds it). ``slot=None`` lets the engine choose (least recently used).
    ``evict``: seats whose adapters leave first, in order, when the pool's free pages and the
    seat's own are not enough (the engine then takes adapters no request needs, least recently
    used first); a seat the engine would not let go now is skipped."""

    slot: int | None = None
    evict: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Defer:
    """Leave the request waiting; it is offered again at the next step."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reject:
    """Fail the request with :class:`BusyRetry`; the client retries after ``retry_after`` s."""

    reason: str
    retry_after: float


AdapterDecision = Load | Defer | Reject
