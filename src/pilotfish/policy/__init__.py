"""Who may get what: node-id rules for identities (:mod:`~pilotfish.policy.authorize`), SDS secret
grants (:mod:`~pilotfish.policy.grants`) and node groups (:mod:`~pilotfish.policy.groups`).

May import ``reconcile`` and every layer below; never ``subsets`` (an independent sibling) or anything above.
"""
