r"""Scoring configuration: policy, declared threat space, secondary contrasts.

Score, re-score and verify a run directory:

  python -m experiments.rescore --workdir=runs/k6_public --config=configs/scoring.py
  python -m experiments.verify --workdir=runs/k6_public
  python -m experiments.validate_measurement --workdir=/tmp/validation
"""

import ml_collections

from lla.scoring import coverage


def get_config(arg=None):
  """Returns the scoring config; `arg`: defenses declared beside the default ones,
  comma-separated (the main job passes those its config runs)."""
  c = ml_collections.ConfigDict()
  # Policy name under lla/scoring/policies/ (or a path to a .json policy).
  c.policy = "scorecard-policy.v3"
  # Declared threat space: the coverage report classifies every cell of
  # families x observations x knowledge x defenses.
  c.threat_space = ml_collections.ConfigDict()
  # Attack families (the `family` of registry entries and records).
  c.threat_space.families = ("ridge", "beam_inversion", "gradient_heuristic",
                             "gradient_matching", "embedding_inversion",
                             "learned_inversion", "sequential_inversion",
                             "decoy_structural", "decoy_content")
  # Observation sets, '+'-joined and sorted, as a module declares them: a split LLM's h
  # and g, and the decoy-row split's frames and returned gradient rows (kinds of their own).
  split_llm = ("activations", "gradients", "activations+gradients")
  decoy_frames = ("decoy_forward", "decoy_gradients", "decoy_forward+decoy_gradients")
  c.threat_space.observations = split_llm + decoy_frames
  # Attacker knowledge of the client weights (PROTOCOL section 1).
  c.threat_space.knowledge = ("public", "trained")
  # Defenses, "none" being the undefended reference, then those `arg` names.
  c.threat_space.defenses = tuple(dict.fromkeys(
      ("none", "gaussian", "topk", "quantize", "mixup", "projection", "gradient_clip_noise",
       "nopeek", "decoy_rows") + tuple(n for n in (arg or "").split(",") if n)))
  # Cells excluded on purpose: {axis: value, ..., "reason": why}; a missing
  # axis matches every value.
  c.threat_space.out_of_scope = (
      {"family": "ridge", "observation": "gradients",
       "reason": "ridge inversion reads activations only"},
      {"family": "gradient_heuristic", "observation": "activations",
       "reason": "the heuristic reads gradients only"},
      {"family": "learned_inversion", "observation": "gradients",
       "reason": "a learned inverter maps activations to tokens"},
      {"family": "sequential_inversion", "observation": "gradients",
       "reason": "sequential inversion verifies activations (g only proposes)"},
  ) + tuple(
      {"family": family, "defense": defense,
       "reason": "decoy-row attacks read the frames of the decoy-row split only"}
      for family in ("decoy_structural", "decoy_content")
      for defense in c.threat_space.defenses if defense != "decoy_rows") + tuple(
      {"observation": observation, "defense": "decoy_rows",
       "reason": "the decoy-row split sends frames of rows, not a split LLM's h or g"}
      for observation in split_llm) + tuple(
      {"observation": observation, "defense": defense,
       "reason": "decoy-row frames exist only in the decoy-row split"}
      for observation in decoy_frames
      for defense in c.threat_space.defenses if defense != "decoy_rows") + tuple(
      {"family": family, "observation": observation,
       "reason": "no module of this family reads decoy-row frames"}
      for family in c.threat_space.families
      if family not in ("decoy_structural", "decoy_content")
      for observation in decoy_frames)
  # Threat classes outside the grid, listed as unmeasured until measured.
  c.threat_space.declared_unmeasured = coverage.PROTOCOL_DECLARED_UNMEASURED
  # Secondary (treatment, control) contrasts at the primary test's cut and
  # knowledge, Bonferroni-corrected together.
  c.secondary = (("shuffled_gradients", "activation"),
                 ("random_candidates", "activation"),
                 ("joint", "shuffled_gradients"))
  # Text ROUGE-L (lla.scoring.similarity) decodes predictions with the GPT-2 tokenizer of
  # $LLA_DATA_DIR; False leaves that metric out (the scorecard says so).
  c.text_rouge = True
  # verify: also check each capture's manifest (needs the capture on disk).
  c.check_capture = True
  return c
