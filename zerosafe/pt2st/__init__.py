"""Any `torch.save` zip file (a state dict, a training checkpoint with optimizer state) to
one safetensors file and back, streaming and lazily, without running code from the file.

`convert_pt` writes the file (`zerosafe pt2st IN.pt OUT.safetensors`), `verify_pt` checks it,
`load_pt_like` loads it as the object `torch.load` gives for the source, and `load_pt` loads
`x.pt` from `x.safetensors` beside it when there is one (for resuming training). The format is
described in `zerosafe.pt2st.convert` (entries) and `zerosafe.pt2st.tree` (the structure).
"""

from zerosafe.pt2st.convert import (
    FORMAT_VERSION,
    PtPlan,
    convert_pt,
    inspect_pt,
    list_pt_globals,
    load_pt_records,
    plan_pt,
    verify_pt,
)
from zerosafe.pt2st.load import load_pt, load_pt_like, safetensors_path_for
from zerosafe.pt2st.tree import entry_name, parse_entry_name

__all__ = [
    "FORMAT_VERSION",
    "PtPlan",
    "convert_pt",
    "entry_name",
    "inspect_pt",
    "list_pt_globals",
    "load_pt",
    "load_pt_like",
    "load_pt_records",
    "parse_entry_name",
    "plan_pt",
    "safetensors_path_for",
    "verify_pt",
]
