"""How a planned job's units run: the steps after planning (`job.py`: `run_job`, and
`RunSettings`), the one scheduler (`schedule.py`), the command's own executor (`local.py`:
threads or worker processes), the worker processes (`workers.py`), the per-unit records that
let a killed run resume (`unit_records.py`) and progress (`progress.py`). The flow's executor,
Prefect tasks, is `zerosafe_app.flows.schedule`."""
