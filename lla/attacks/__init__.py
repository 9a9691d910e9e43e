"""Attacks on split-learning messages, and the engine an attack is written against.

The engine (this package's top level) is what a plugin may import:

* `registry`: AttackSpec, AttackResult, `register`, compatibility with a capture;
* `budget`: the declared budget fields and their validation;
* `workspace`: a capture's messages and the attacker's model, metered compiled calls;
* `memory`: the document-chunking memory model (each attack declares its stages);
* `candidates`, `ridge`: candidate ranking against the vocabulary (ridge decoder,
  gradient ranking, nearest rows);
* `optimise`: embedding-space optimisation through the client layers;
* `downstream`: the server's part of the model, for gradient matching.

The attacks live in wings, each registered on import (`registry.BUILTIN_MODULES`):
`seed/` (PROTOCOL section 4), `published/` (the literature's attacks, section 4b) and
`adaptive/` (attacks that exploit a defense's mechanism, section 5a). Running attacks on a
capture and writing a run is `lla.replay`'s job, not the engine's.
"""
