"""Deployment entrypoint `flows/pt2st.py:pt2st`: the flow is `zerosafe_app.flows.pt2st.pt2st`."""

from zerosafe_app.flows.pt2st import *  # noqa: F403
from zerosafe_app.flows.pt2st import pt2st

__all__ = ["pt2st"]
