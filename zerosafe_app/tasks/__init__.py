"""Prefect tasks, one module per stage: thin wrappers that call the engine (`zerosafe`) and
return small JSON-able summaries, never tensors."""
