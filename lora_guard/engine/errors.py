"""Why the engine refuses a request."""

from __future__ import annotations


class RequestError(ValueError):
    """A request cannot be accepted as given (unknown adapter, too long, bad prompt)."""


class UnknownAdapterError(RequestError):
    """The request names an adapter the engine does not know."""
