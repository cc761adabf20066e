"""What zerosafe writes (`--to`): the output-target contract (`base.py`), the registry of
targets (`registry.py`) and the training-state lifecycle (`lifecycle.py`)."""
