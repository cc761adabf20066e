"""How a job's units run once it is planned: the worker processes (`workers.py`), the
per-unit records that let a killed run resume (`unit_records.py`) and progress
(`progress.py`)."""
