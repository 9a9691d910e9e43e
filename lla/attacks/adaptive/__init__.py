"""Adaptive attacks: each knows one defense's mechanism and public parameters, never its
secret (PROTOCOL section 5a; design notes in ../shared/notes/adaptive-attacks.md).

* `common`: the shared last step (ridge candidates and the beam search on reconstructed
  messages) and the defense's public parameters.
* `projection_adaptive`: against the secret random projection.
* `mixup_adaptive`: against mixup of client activations.
* `likelihood_beam`: a beam scored by the likelihood of the defended message (noise,
  compression, clipping).
* `nopeek_adaptive`: against NoPeek (distance-correlation) training.
* `dx_privacy_adaptive`: against d_chi noise on the input embeddings (`dx_privacy`,
  `snd`): the noisy embeddings recovered from h, then the posterior beam.
"""
