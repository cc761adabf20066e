"""Which flattened state-dict keys are optimizer state, never to be written as weights.

torch's optimizers name their state `state.<param>.<key>` and `param_groups.<i>.<field>`
(`torch.optim.Optimizer.state_dict`; `get_optimizer_state_dict` keys `state` by the param's
FQN). Savers put that under a key of their own: `optim.` (torchtitan, OLMo-core,
`get_state_dict` recipes), `optimizer.` (accelerate's `optimizer_N/`), or deeper, as PyTorch's
DCP recipe does with `{"app": AppState(model, optim)}` (`app.optim.state.0.weight.exp_avg`).
"""

from __future__ import annotations

import re

__all__ = ["OPTIMIZER_STATE", "is_optimizer_state"]

OPTIMIZER_STATE = re.compile(
    r"(^|\.)(optim|optimizer)(\.|$)"
    r"|(^|\.)param_groups(\.|$)"
    r"|(^|\.)state\..+\.(exp_avg|exp_avg_sq|max_exp_avg_sq|step|momentum_buffer|sum|"
    r"square_avg|acc_delta)$"
)
"""A key under an `optim`/`optimizer` component or `param_groups`, or a moment of torch's
optimizers (Adam/AdamW, SGD, Adagrad, RMSprop, Adadelta) under a `state` component."""


def is_optimizer_state(name: str) -> bool:
    """Whether the flattened key `name` is optimizer state (see `OPTIMIZER_STATE`)."""
    return OPTIMIZER_STATE.search(name) is not None
