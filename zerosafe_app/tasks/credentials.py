"""Storage credentials, resolved inside the process that uses them, never passed as parameters.

Flow and task parameters are stored by the Prefect server and shown in its UI, so a job's
`storage_options` carry no secrets (`zerosafe_app.flows.config.JobConfig` refuses them). They name where the
credentials are instead, in the `credentials` option, resolved here just before storage opens:

- `secret/NAME` (or just `NAME`): a Prefect `Secret` block whose value is a JSON object with
  `aws_access_key_id`, `aws_secret_access_key` and optionally `aws_session_token` (`key`,
  `secret` and `token` also work);
- `aws-credentials/NAME`: an `AwsCredentials` block of the prefect-aws collection, if installed;
- `env`: nothing to resolve; botocore reads the environment, the profile or the instance role.

Without `credentials`, s3fs finds credentials where the AWS CLI does (environment variables,
`AWS_PROFILE` or the `profile` option, `~/.aws/config`, instance roles).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from zerosafe.errors import ConfigError
from zerosafe.io.storage import IOCounter, Storage

__all__ = ["resolve_storage_options", "storage_for"]

_TTL_SECONDS = 300.0
"""Resolved credentials are reused this long per process (tasks open storage many times)."""

_cache: dict[str, tuple[float, dict[str, Any]]] = {}
_lock = threading.Lock()

_KEY_NAMES = {
    "key": ("aws_access_key_id", "key", "access_key_id"),
    "secret": ("aws_secret_access_key", "secret", "secret_access_key"),
    "token": ("aws_session_token", "token", "session_token"),
}


def _plain(value: Any) -> Any:
    get = getattr(value, "get_secret_value", None)
    return get() if callable(get) else value


def _from_mapping(ref: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise ConfigError(
            f"credentials block '{ref}' must hold a JSON object with `aws_access_key_id` and "
            "`aws_secret_access_key` (and optionally `aws_session_token`)"
        )
    out: dict[str, Any] = {}
    for option, names in _KEY_NAMES.items():
        for name in names:
            if value.get(name):
                out[option] = str(_plain(value[name]))
                break
    if "key" not in out or "secret" not in out:
        raise ConfigError(
            f"credentials block '{ref}' lacks `aws_access_key_id` or `aws_secret_access_key` "
            f"(it has the fields {sorted(value)})"
        )
    return out


def _from_block(ref: str, block: Any) -> dict[str, Any]:
    if hasattr(block, "aws_access_key_id"):  # prefect-aws AwsCredentials
        out: dict[str, Any] = {}
        if block.aws_access_key_id:
            out["key"] = str(block.aws_access_key_id)
        if getattr(block, "aws_secret_access_key", None):
            out["secret"] = str(_plain(block.aws_secret_access_key))
        if getattr(block, "aws_session_token", None):
            out["token"] = str(_plain(block.aws_session_token))
        if getattr(block, "profile_name", None):
            out["profile"] = block.profile_name
        if getattr(block, "region_name", None):
            out["region"] = block.region_name
        return out
    if hasattr(block, "get"):  # prefect.blocks.system.Secret
        return _from_mapping(ref, block.get())
    raise ConfigError(
        f"credentials block '{ref}' is a {type(block).__name__}; use a Secret or an "
        "AwsCredentials block"
    )


def _load(ref: str) -> dict[str, Any]:
    from prefect.blocks.core import Block

    slug = ref if "/" in ref else f"secret/{ref}"
    try:
        # Forced sync: Prefect may first need the credentials inside its event loop (result
        # storage), where a plain `load` would hand back a coroutine.
        block = Block.load(slug, _sync=True)  # type: ignore[call-arg]
    except (ValueError, KeyError) as e:
        raise ConfigError(
            f"storage option `credentials`: no block '{slug}' on the Prefect server "
            f"({type(e).__name__}). Create it (e.g. `Secret(value={{...}}).save('NAME')`) or fix "
            "the name."
        ) from None
    return _from_block(slug, block)


def resolve_storage_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` with its `credentials` reference replaced by the credentials it names.

    Raises:
        ConfigError: If the reference names no usable block.
    """
    options = dict(options or {})
    ref = options.pop("credentials", None)
    if ref is None or ref == "env":
        return options
    if not isinstance(ref, str) or not ref:
        raise ConfigError(
            "storage option `credentials` must be a block reference like 'secret/NAME'"
        )
    now = time.monotonic()
    with _lock:
        hit = _cache.get(ref)
    if hit is None or now - hit[0] > _TTL_SECONDS:
        hit = (now, _load(ref))
        with _lock:
            _cache[ref] = hit
    resolved = dict(hit[1])
    # Job options win over the block's profile or region; the keys come from the block only.
    for name in ("profile", "region"):
        if name in options:
            resolved.pop(name, None)
    return {**options, **resolved}


def storage_for(options: dict[str, Any] | None, counter: IOCounter | None = None) -> Storage:
    """A `Storage` for a job's (secret-free) storage options, credentials resolved."""
    return Storage(resolve_storage_options(options), counter)
