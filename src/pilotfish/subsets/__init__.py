"""Where the subsetting index assignments are kept: a state file (:mod:`~pilotfish.subsets.state`) or
etcd, shared by replicas (:mod:`~pilotfish.subsets.etcd`).

May import ``reconcile`` and every layer below (the etcd client for etcd); never ``policy`` (an
independent sibling) or anything above.
"""
