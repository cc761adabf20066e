"""Training state out of a ZeRO checkpoint: the masters and Adam moments, resharded.

`convert_to_universal` writes a DeepSpeed universal checkpoint (what `ds_to_universal.py`
writes, plus `latest_universal`), so DeepSpeed resumes the run at any world size;
`convert_to_dcp` writes the model and AdamW state as a PyTorch DCP checkpoint in
`get_state_dict`'s layout, so an FSDP2 run resumes it (docs/training-state.md).
"""

from __future__ import annotations

from zerosafe.training_state.dcp import DcpSummary, convert_to_dcp
from zerosafe.training_state.dcp_plan import DcpPlan, plan_dcp
from zerosafe.training_state.universal import UniversalSummary, convert_to_universal
from zerosafe.training_state.universal_plan import UniversalPlan, plan_universal

__all__ = [
    "DcpPlan",
    "DcpSummary",
    "UniversalPlan",
    "UniversalSummary",
    "convert_to_dcp",
    "convert_to_universal",
    "plan_dcp",
    "plan_universal",
]
