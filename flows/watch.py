"""Deployment entrypoint `flows/watch.py:watch`: the flow is `zerosafe_app.flows.watch.watch`."""

from zerosafe_app.flows.watch import *  # noqa: F403
from zerosafe_app.flows.watch import watch

__all__ = ["watch"]
