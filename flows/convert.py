"""Deployment entrypoint `flows/convert.py:convert`: the flow is `zerosafe_app.flows.convert.convert`."""

from zerosafe_app.flows.convert import *  # noqa: F403
from zerosafe_app.flows.convert import convert

__all__ = ["convert"]

if __name__ == "__main__":  # `python flows/convert.py conf.yaml`
    import json
    import sys

    print(json.dumps(convert(conf=sys.argv[1]), indent=1, default=str))
