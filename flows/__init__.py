"""Deployment entrypoints of zerosafe's Prefect flows (`flows/convert.py:convert`, ...).

The flows live in the installed package `zerosafe_app.flows`; these files re-export them so
`deploy/prefect.yaml` and `python flows/convert.py conf.yaml` work from a checkout of the
repository. Nothing here is installed into site-packages.
"""
