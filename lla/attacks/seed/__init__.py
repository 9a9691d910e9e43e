"""The seed protocol's attacks (PROTOCOL section 4).

* `beam`: the KV-cached beam search over candidate tokens, compiled as one loop.
* `beam_attacks`: ridge alone, activation-only, joint activation+gradient, the FLOP-matched
  activation baseline, the negative controls (shuffled gradients, random candidates) and
  the defense-aware variants.
* `heuristics`: the gradient-only attacks (gradient ranking without a search).
"""
