"""xDS protocol state machines, without I/O: requests in, decisions out."""

from pilotfish.protocol.sotw import Nonce, RequestKind, RequestOutcome, SotwStream, TypeState
from pilotfish.protocol.subscription import (
    WILDCARD,
    Subscription,
    Watch,
    needs_response,
    next_subscription,
)

__all__ = [
    "WILDCARD",
    "Nonce",
    "RequestKind",
    "RequestOutcome",
    "SotwStream",
    "Subscription",
    "TypeState",
    "Watch",
    "needs_response",
    "next_subscription",
]
