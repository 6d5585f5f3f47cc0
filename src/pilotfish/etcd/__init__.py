"""etcd: the client, the election, and :mod:`~pilotfish.etcd.member` (the etcd launcher for tests and
bench, plain blocking code).

May import ``build`` and the layers below; never a source, a store or a service (they import it).
Nothing is re-exported here, so that importing the launcher loads no aiohttp.
"""
