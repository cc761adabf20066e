"""The flow `convert` hands every parameter to the job config by name (no `locals()`), and
its parameters are exactly the job config's fields plus `conf`."""

from __future__ import annotations

import ast
import inspect
import textwrap

from zerosafe_app.flows.config import JobConfig
from zerosafe_app.flows.convert import convert


def test_every_flow_parameter_reaches_the_job_config() -> None:
    parameters = [n for n in inspect.signature(convert.fn).parameters if n != "conf"]
    assert sorted(parameters) == sorted(JobConfig.model_fields)
    tree = ast.parse(textwrap.dedent(inspect.getsource(convert.fn)))
    (call,) = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "params" for t in node.targets)
    ]
    assert isinstance(call, ast.Call)
    passed = {k.arg: k.value.id for k in call.keywords if isinstance(k.value, ast.Name)}
    assert passed == {name: name for name in parameters}
