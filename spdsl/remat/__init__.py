"""Rematerialisation: what a rank keeps from forward to backward, and what it recomputes.

``remat=`` on ``sp_shard``/``shard`` picks the policy (:class:`Remat`); :func:`apply_remat`
rewrites one rank's local graph accordingly (tiling, per-layer checkpoints, a SAC policy).
"""

from spdsl.remat.config import Remat, RematChoice, parse_bytes
from spdsl.remat.policy import SavePolicy
from spdsl.remat.transform import RematReport, apply_remat

__all__ = ["Remat", "RematChoice", "RematReport", "SavePolicy", "apply_remat", "parse_bytes"]
