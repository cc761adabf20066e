"""Deployment entrypoint `flows/lazify.py:lazify`: the flow is `zerosafe_app.flows.lazify.lazify`."""

from zerosafe_app.flows.lazify import *  # noqa: F403
from zerosafe_app.flows.lazify import lazify

__all__ = ["lazify"]
