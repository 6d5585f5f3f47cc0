"""Desired state into a snapshot: :mod:`~pilotfish.build.desired` (desired state -> snapshot),
:mod:`~pilotfish.build.validate` (the rules a snapshot must satisfy) and :mod:`~pilotfish.build.subsetting`
(Ringsteady arithmetic).

Pure computation: may import ``snapshot``, ``resources`` and ``errors``; no asyncio, grpc or aiohttp.
"""
