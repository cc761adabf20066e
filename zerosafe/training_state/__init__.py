"""Training state out of a ZeRO checkpoint: the masters and Adam moments, resharded.

`convert_to_universal` writes a DeepSpeed universal checkpoint (what `ds_to_universal.py`
writes, plus `latest_universal`), so DeepSpeed resumes the run at any world size
(docs/training-state.md).
"""

from __future__ import annotations

from zerosafe.training_state.universal import UniversalSummary, convert_to_universal
from zerosafe.training_state.universal_plan import UniversalPlan, plan_universal

__all__ = ["UniversalPlan", "UniversalSummary", "convert_to_universal", "plan_universal"]
