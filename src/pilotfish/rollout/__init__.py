"""Progressive delivery of configuration: a candidate snapshot goes to waves of proxies, each gated on
the proxies' ACKs and their load reports, and is rolled back and held when a gate fails
(docs/rollout.md).

Everything here is sans-IO: values in, decisions and events out, time from the caller.
:mod:`~pilotfish.rollout.waves` parses ``--rollout`` and assigns each proxy its wave;
:mod:`~pilotfish.rollout.load` decodes LRS reports and keeps a windowed, bounded load store;
:mod:`~pilotfish.rollout.gates` holds the ACK gate and the error-ratio arithmetic;
:mod:`~pilotfish.rollout.machine` is the rollout state machine, the one owner of its transitions.

May import ``policy`` (node-id globs) and every layer below; never asyncio, grpc or aiohttp, and
nothing above (the xDS services, the APIs and the composition root drive it).
"""
