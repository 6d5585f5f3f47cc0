"""xDS protocol state machines, without I/O: requests in, decisions out."""

from pilotfish.protocol.delta import DeltaKind, DeltaOutcome, DeltaStream, DeltaTypeState, DeltaWatch
from pilotfish.protocol.limits import DEFAULT_LIMITS, PeerOverLimit, XdsLimits
from pilotfish.protocol.sotw import Nonce, RequestKind, RequestOutcome, SotwStream, TypeState
from pilotfish.protocol.subscription import (
    WILDCARD,
    ResourceState,
    Subscription,
    Watch,
    holds_ttls,
    needs_response,
    next_subscription,
)

__all__ = [
    "DEFAULT_LIMITS",
    "WILDCARD",
    "DeltaKind",
    "DeltaOutcome",
    "DeltaStream",
    "DeltaTypeState",
    "DeltaWatch",
    "Nonce",
    "PeerOverLimit",
    "RequestKind",
    "RequestOutcome",
    "ResourceState",
    "SotwStream",
    "Subscription",
    "TypeState",
    "Watch",
    "XdsLimits",
    "holds_ttls",
    "needs_response",
    "next_subscription",
]
