"""Checking the work of workers one does not trust: commitments, spot-checks, contribution scores."""

from fusionnode.verify.commitment import DIGEST_KEY, digest_encoded, digest_tensors
from fusionnode.verify.compare import CPU_REL_TOL, Mismatch, compare_tensors, tolerance_for
from fusionnode.verify.ledger import Ledger
from fusionnode.verify.liar import Liar
from fusionnode.verify.policy import VerifyPolicy, resolve_policy
from fusionnode.verify.score import robust_aggregate, score_contributions, weights_from_scores
from fusionnode.verify.selector import CheckSelector, check_reveal, steps_to_catch

__all__ = [
    "CPU_REL_TOL",
    "DIGEST_KEY",
    "CheckSelector",
    "Ledger",
    "Liar",
    "Mismatch",
    "VerifyPolicy",
    "check_reveal",
    "compare_tensors",
    "digest_encoded",
    "digest_tensors",
    "resolve_policy",
    "robust_aggregate",
    "score_contributions",
    "steps_to_catch",
    "tolerance_for",
    "weights_from_scores",
]
