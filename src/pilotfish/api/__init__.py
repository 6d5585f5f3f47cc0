"""The HTTP APIs on aiohttp: the admin API and status page (:mod:`~pilotfish.api.admin`), the
registry HTTP API and its stores (:mod:`~pilotfish.api.registry`, :mod:`~pilotfish.api.registry_etcd`),
Prometheus metrics (:mod:`~pilotfish.api.metrics`) and bearer tokens with scopes (:mod:`~pilotfish.api.tokens`).

May import ``xds`` (the admin API renders responses as REST xDS does) and every layer below; only
``app`` and ``commands`` import it.
"""
