"""The active-server tier: a malicious server writes the gradients it returns.

In split training the server does not only read the forward message h; it also writes the
backward message g that trains the client's layers. This package simulates split
fine-tuning with an honest or a malicious server and measures what the malicious one gains
and what the client can detect:

  protocol.py    the two messages (Forward, Backward): nothing else crosses the boundary
  parts.py       the two parties' shares of a GPT-2 and the server's forward
  client.py      the client: its layers, optimiser, the trusted loss oracle, detectors' probes
  servers.py     HonestServer, FSHAServer, MixedFSHAServer (never import client code or data)
  fsha.py        FSHA's pilot, decoder and critic for GPT-2 (Pasquini et al., CCS'21)
  public.py      the server's public text (WikiText-2 train, disjoint from the client's)
  detectors.py   SplitGuard-LM and the reference-cosine test, thresholds, TPR / FPR
  run.py         the only code holding both parties' states: the jitted steps, captures
  attack.py      the registered attack `fsha_decode` (replays a stored decoder on a capture)
  decoy_probe.py an active probe of the decoy-row split (PROTOCOL section 7)
  report.py      the main job's "active server" section

docs/active_server.md describes the design; configs/active.py the runs.
"""
