"""Scoring: metrics, gates, bootstrap, coverage, qualification, scorecard.

The main job records its threat space (lla.scoring.threat_space), calls
`score_run(run_dir, cfg, qualification_evidence=...)` (or `build` + `write`), then
`lla.evidence.rundir.finalize(run_dir)`. Scoring reads the study's files alone: it imports
nothing from lla.attacks, lla.replay or lla.study (tests/test_layering.py).
"""

from lla.scoring.bootstrap import bonferroni
from lla.scoring.bootstrap import evaluate_primary
from lla.scoring.bootstrap import interval
from lla.scoring.bootstrap import PrimaryTest
from lla.scoring.coverage import PROTOCOL_DECLARED_UNMEASURED
from lla.scoring.coverage import ThreatSpace
from lla.scoring.gates import decide
from lla.scoring.gates import FAIL
from lla.scoring.gates import INSUFFICIENT
from lla.scoring.gates import PASS
from lla.scoring.metrics import envelope
from lla.scoring.metrics import exact_document_recovery
from lla.scoring.metrics import excess_pp
from lla.scoring.metrics import floor_pp
from lla.scoring.metrics import token_recovery
from lla.scoring.metrics import wilson_upper
from lla.scoring.policy import load_policy
from lla.scoring.qualification import matrix as qualification_matrix
from lla.scoring.scorecard import build as build_scorecard
from lla.scoring.scorecard import markdown as scorecard_markdown
from lla.scoring.scorecard import score_run
