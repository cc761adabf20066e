"""The Prefect edge: one task decorator, one retry policy, and one conversion between the
engine's result dataclasses and the JSON Prefect persists, caches, ships to workers and shows.

A task body takes and returns the engine's types (`Job`, `ExtractResult`, `MergeResult`,
...); `stage_task` wraps it so that Prefect only ever sees their JSON: an argument whose
annotation has a `from_json` classmethod (or is a list of one) is built from the JSON it
receives, and a return value with `to_json` is turned into JSON. Cache keys, persisted results
and what the flow passes are therefore the same JSON as before the types existed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args, get_origin, get_type_hints

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from zerosafe.errors import ConversionError
from zerosafe.io.s3 import is_transient_error

__all__ = ["TRANSIENT_STORAGE", "RetryPolicy", "from_edge", "is_transient", "stage_task", "to_edge"]


def is_transient(_task: Any, _run: Any, state: Any) -> bool:
    """Retry storage hiccups (S3 throttling and 5xx, timeouts, resets mid-body), never bad
    input, permissions, missing buckets or keys, or full disks (`zerosafe.io.s3`)."""
    try:
        state.result()
    except ConversionError:
        return False
    except Exception as e:
        return is_transient_error(e)
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """When a failed task runs again: `retries` times, after `delays_s`, where `condition`
    says the failure may pass."""

    retries: int
    delays_s: tuple[float, ...]
    condition: Callable[[Any, Any, Any], bool]

    def task_options(self) -> dict[str, Any]:
        """The policy as `prefect.task` arguments."""
        return {
            "retries": self.retries,
            "retry_delay_seconds": list(self.delays_s),
            "retry_condition_fn": self.condition,
        }


TRANSIENT_STORAGE = RetryPolicy(retries=3, delays_s=(2, 10, 30), condition=is_transient)
"""Every task's policy: three more tries over some 40 s, for transient storage errors only
(the engine does not retry; a bad input fails at once)."""


def to_edge(value: Any) -> Any:
    """What Prefect gets for a task's return value: its `to_json()` where it has one (a list
    or tuple of such, element by element); anything else as it is."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, list | tuple) and value and all(hasattr(v, "to_json") for v in value):
        return [v.to_json() for v in value]
    return value


def from_edge(value: Any, hint: Any) -> Any:
    """A task argument as its body wants it: built by the annotation's `from_json` from the
    JSON Prefect passed (a list of them for `list[...]`/`Sequence[...]`); an argument that is
    already of that type, or whose annotation has no `from_json`, as it is."""
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        return hint.from_json(value) if isinstance(value, Mapping) else value
    if get_origin(hint) in (list, tuple, Sequence) and isinstance(value, list | tuple):
        (item, *_) = get_args(hint) or (None,)
        return [from_edge(v, item) for v in value]
    return value


def stage_task(
    name: str,
    *,
    run_name: str,
    cache_key_fn: Callable[..., str | None] | None = None,
) -> Callable[[Callable[..., Any]], Task[..., dict[str, Any]]]:
    """The decorator every task of zerosafe's flows uses: the JSON edge (`to_edge`,
    `from_edge`), `TRANSIENT_STORAGE` retries, and caching by `cache_key_fn` with persisted
    results (`None`: never cached).

    Args:
        name: The task's name (its stage verb).
        run_name: The run name template (`merge shard {number}/{count}`).
        cache_key_fn: The unit's cache key (`zerosafe_app.tasks._common.cache_key`).
    """

    def wrap(fn: Callable[..., Any]) -> Task[..., dict[str, Any]]:
        signature = inspect.signature(fn)
        hints = get_type_hints(fn)

        @functools.wraps(fn)
        def edge(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            for key, value in bound.arguments.items():
                bound.arguments[key] = from_edge(value, hints.get(key))
            return to_edge(fn(*bound.args, **bound.kwargs))

        caching: dict[str, Any] = (
            {"cache_key_fn": cache_key_fn, "persist_result": True}
            if cache_key_fn is not None
            else {"cache_policy": NO_CACHE}
        )
        # Typed as what Prefect's callers get: the JSON of the body's result (`finish` and
        # other bodies that return None give None).
        made: Task[..., dict[str, Any]] = task(
            name=name, task_run_name=run_name, **caching, **TRANSIENT_STORAGE.task_options()
        )(edge)
        return made

    return wrap
