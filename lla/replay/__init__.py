"""The replay driver: runs registered attacks on a stored capture and writes a run.

* `driver`: one replay (capture check, attacker model, budgets, records, predictions),
  resumable, and the followers of a multi-process replay.
* `runner`: a replay from a config (the `experiments.replay` binary's logic).
* `regenerate`: re-runs a recorded attack and compares predictions bit for bit.

Attacks never import this package; it imports them through `lla.attacks.registry`.
"""
