"""Published attacks, reimplemented against the engine (PROTOCOL section 4b; design notes
in ../shared/notes/published-attacks.md).

* `sipit`: SipIt, exact inversion of hidden states by sequential vocabulary search
  (Nikolaou et al., ICLR 2026).
* `sip`: SIP, a learned inversion model (SplitLLM).
* `bisr_f`: BiSR's forward stage, embedding optimisation seeded by SIP (Chen et al., CCS 2024).
* `eia`: EIA, embedding inversion through the client layers (SplitLLM).
* `gradmatch`: gradient matching (TAG, BiSR(b)).
* `lamp`: LAMP, gradient matching with a language-model prior (Balunovic et al., 2022).
"""
