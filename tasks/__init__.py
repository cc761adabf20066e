"""zerosafe's Prefect tasks live in the installed package `zerosafe_app.tasks`, one module per
stage (inspect, extract, merge, verify, publish, pt2st). This folder stays so older deployment
code that imported `tasks.<stage>` finds where they went; it is not installed."""
