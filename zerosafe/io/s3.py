"""Amazon S3 and S3-compatible stores, through s3fs: options, bounded multipart uploads, error
triage, and the uploads a killed run leaves behind.

S3 API reference: https://docs.aws.amazon.com/AmazonS3/latest/API/ (`CreateMultipartUpload`,
`UploadPart`, `CompleteMultipartUpload`, `AbortMultipartUpload`, `ListMultipartUploads`,
`ListParts`). Limits (https://docs.aws.amazon.com/AmazonS3/latest/userguide/qfacts.html): every
part but the last holds 5 MiB to 5 GiB, and an upload has at most 10,000 parts. An object made
by a multipart upload appears only when `CompleteMultipartUpload` succeeds; until it is aborted,
an unfinished upload keeps (and bills) its parts.

Credentials never pass through here as job options: s3fs (botocore) finds them in the usual
places (`AWS_ACCESS_KEY_ID`..., `AWS_PROFILE`, `~/.aws/config`, instance roles; the endpoint in
`AWS_ENDPOINT_URL`), or the flow's tasks resolve a `credentials` block reference into `key`,
`secret` and `token` inside the task's process, just before opening storage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerosafe.errors import CheckpointFormatError, ConfigError, ConversionError, StorageError
from zerosafe.units import parse_size

__all__ = [
    "IncompleteUpload",
    "S3MultipartSink",
    "SECRET_OPTION_KEYS",
    "TransferSettings",
    "abort_upload",
    "find_secret_options",
    "fsspec_options",
    "is_transient_error",
    "list_incomplete_uploads",
    "parse_option_pairs",
    "redact_options",
    "split_transfer_options",
    "translate_error",
]

log = logging.getLogger(__name__)

MIB = 2**20
MAX_PARTS = 10_000
PARTS_PER_SIZE_STEP = 1_000
"""Every this many parts the part size doubles, so any object fits in `MAX_PARTS` parts."""

SECRET_OPTION_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "sse_customer_key",
        "ssecustomerkey",
        "account_key",
        "sas_token",
        "connection_string",
        "client_secret",
    }
)
"""Option names whose values are secrets: never accepted as job parameters or CLI flags."""

_TRANSFER_KEYS = ("part_size", "range_size", "max_requests")


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferSettings:
    """How zerosafe moves bytes to and from an object store (not passed to fsspec)."""

    part_bytes: int = 8 * MIB
    """Multipart part size (storage option `part_size`); S3 wants at least 5 MiB."""
    range_bytes: int = 8 * MIB
    """A large read is split into ranged GETs of this size (storage option `range_size`); it is
    also the largest request that the copy pipeline's coalesced reads make
    (`zerosafe.io.coalesce`)."""
    max_requests: int = 4
    """Ranged GETs or part uploads in flight at once per reader or writer (`max_requests`); a
    copy's coalesced reads keep `2 * max_requests` in flight.
    Memory: a writer holds `(max_requests + 1) * part_bytes`; a read in flight holds at most
    `max_requests * range_bytes` of response bodies besides its own buffer (coalesced reads
    count their responses in the copy's budget)."""

    def __post_init__(self) -> None:
        if self.part_bytes < 1 or self.range_bytes < 1 or self.max_requests < 1:
            raise ConfigError(
                "storage options `part_size`, `range_size` and `max_requests` must be positive"
            )


def split_transfer_options(options: dict[str, Any]) -> tuple[dict[str, Any], TransferSettings]:
    """Separate zerosafe's own transfer options from the ones meant for fsspec."""
    rest = {k: v for k, v in options.items() if k not in _TRANSFER_KEYS}
    kw: dict[str, int] = {}
    for key, field in (("part_size", "part_bytes"), ("range_size", "range_bytes")):
        if key in options:
            value = options[key]
            kw[field] = parse_size(value) if isinstance(value, str) else int(value)
    if "max_requests" in options:
        kw["max_requests"] = int(options["max_requests"])
    return rest, TransferSettings(**kw)


def find_secret_options(options: Any, where: str = "storage_options") -> list[str]:
    """Dotted names of every secret-looking key in `options`, nested dicts included."""
    found: list[str] = []
    if isinstance(options, dict):
        for key, value in options.items():
            name = f"{where}.{key}"
            if str(key).lower() in SECRET_OPTION_KEYS:
                found.append(name)
            else:
                found.extend(find_secret_options(value, name))
    return found


STORAGE_OPTION_HELP = (
    "storage option for s3:// (or other fsspec) URLs, repeatable: endpoint_url=URL, "
    "profile=NAME, region=NAME, anon=true, part_size=8MiB, range_size=8MiB, max_requests=4, "
    "credentials=secret/NAME (a Prefect block), or any s3fs option (dots nest: "
    "config_kwargs.read_timeout=30). Credentials themselves come from the AWS environment "
    "(AWS_ACCESS_KEY_ID..., AWS_PROFILE, AWS_ENDPOINT_URL), ~/.aws or the instance role."
)


def _coerce(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if text.startswith(("{", "[")):
        import json

        try:
            return json.loads(text)
        except ValueError:
            return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_option_pairs(pairs: list[str]) -> dict[str, Any]:
    """`["endpoint_url=http://...", "config_kwargs.read_timeout=5"]` -> a nested dict.

    Raises:
        ConfigError: On a malformed pair, or a secret (keys belong in the environment, a
            profile, or a Prefect block named by `credentials`).
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option '{pair.split('=')[0]}...': expected KEY=VALUE")
        path = [k.strip() for k in key.split(".")]
        target = out
        for name in path[:-1]:
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--storage-option {key}: '{name}' is not a group of options")
        target[path[-1]] = text if path[-1] == "credentials" else _coerce(text)
    secrets = find_secret_options(out, "--storage-option")
    if secrets:
        raise ConfigError(
            f"{', '.join(secrets)}: credentials are not accepted on the command line (they "
            "would show in the process list and in the flow's parameters). Set "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, use "
            "`profile=NAME`, or `credentials=secret/NAME` for a Prefect Secret block."
        )
    return out


def redact_options(options: dict[str, Any]) -> dict[str, Any]:
    """A copy fit for logs: secret values replaced by '***'."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if str(key).lower() in SECRET_OPTION_KEYS:
            out[key] = "***"
        elif isinstance(value, dict):
            out[key] = redact_options(value)
        else:
            out[key] = value
    return out


def fsspec_options(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """Job storage options -> keyword arguments of `fsspec.filesystem(protocol, ...)`.

    For S3, `region` becomes the client's `region_name`, `profile` selects an AWS profile, and
    listings are never cached (other processes write the same prefixes: a cached listing would
    hide their files). Other keys pass through to s3fs unchanged.

    Raises:
        ConfigError: If `credentials` (a Prefect block reference) arrives unresolved.
    """
    if "credentials" in options:
        raise ConfigError(
            "storage option `credentials` names a Prefect block, which only the flow's tasks "
            "resolve; the engine got it unresolved. Run through the flow (`zerosafe convert`), "
            "or give the engine `key`/`secret`/`token` or rely on the AWS environment."
        )
    out = dict(options)
    if protocol in ("s3", "s3a"):
        region = out.pop("region", None)
        if region:
            out["client_kwargs"] = {**out.get("client_kwargs", {}), "region_name": region}
        if isinstance(out.get("anon"), str):
            out["anon"] = out["anon"].lower() in ("1", "true", "yes")
        out.setdefault("use_listings_cache", False)
    return out


# -- errors ----------------------------------------------------------------------------------

_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable, 409 conflicts
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
        errno.ESTALE,  # NFS: a stale handle; the retried task opens the file again
    }
)
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "HTTPClientError",  # botocore: connection closed, read/connect timeouts, endpoint down
        "ClientPayloadError",  # aiohttp: body cut short (connection reset mid-body)
        "ServerDisconnectedError",
        "ClientConnectionError",
        "FSTimeoutError",
        "IncompleteRead",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ResponseParserError",  # throttling responses with broken XML (s3fs issue 484)
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient_error(exc: BaseException) -> bool:
    """Whether retrying later can cure `exc`: throttling, 5xx, timeouts, dropped connections.

    Errors zerosafe raised on purpose (`ConversionError`) never are, nor are permissions,
    missing buckets or keys, or full disks.
    """
    for e in _chain(exc):
        if isinstance(e, ConversionError):
            return False
        if isinstance(e, (PermissionError, FileNotFoundError, FileExistsError)):
            return False
        if isinstance(e, (TimeoutError, ConnectionError)):
            return True
        if _error_code(e) in _TRANSIENT_CODES:
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _fix_for_access() -> str:
    return (
        "Check the credentials in use (AWS_ACCESS_KEY_ID/AWS_PROFILE in the environment, the "
        "`profile` storage option, the instance role, or the block named by the `credentials` "
        "storage option), the bucket policy, and `endpoint_url`/`region`."
    )


def translate_error(exc: BaseException, url: str, op: str) -> ConversionError | None:
    """A user-facing error for a permanent storage failure, or None to let `exc` propagate.

    Transient errors return None (the task retries them); so do errors of unknown kind.
    Messages name the URL and the likely fix, never the credentials.
    """
    if isinstance(exc, ConversionError) or is_transient_error(exc):
        return None
    codes = {c for e in _chain(exc) if (c := _error_code(e)) is not None}
    text = " ".join(str(e) for e in _chain(exc))
    bucket = _bucket_of(url)
    if "NoSuchBucket" in codes or "NoSuchBucket" in text or "bucket does not exist" in text:
        return StorageError(
            f"{url}: bucket '{bucket}' does not exist ({op}). Check the bucket name in the URL, "
            "and the `endpoint_url` and `region` storage options (or AWS_ENDPOINT_URL) if the "
            "bucket lives on another endpoint."
        )
    if isinstance(exc, PermissionError) or codes & {"AccessDenied", "403", "InvalidAccessKeyId"}:
        return StorageError(f"{url}: access denied ({op}). {_fix_for_access()}")
    if isinstance(exc, FileNotFoundError) or codes & {"NoSuchKey", "404"}:
        if op == "write":
            return StorageError(
                f"{url}: the upload was not found when completing it ({op}); an abort from "
                "elsewhere (`zerosafe clean --apply`?) removed it. Run the conversion again."
            )
        return CheckpointFormatError(
            f"{url}: not found ({op}). Check the URL; a checkpoint copy may be incomplete."
        )
    return None


def _bucket_of(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


@contextlib.contextmanager
def translated_errors(url: str, op: str) -> Iterator[None]:
    """Raise `translate_error`'s error (from the original) for permanent failures."""
    try:
        yield
    except Exception as e:
        err = translate_error(e, url, op)
        if err is None:
            raise
        raise err from e


# -- multipart upload --------------------------------------------------------------------------


class S3MultipartSink:
    """Streams one object to S3 in bounded parts; it becomes visible only on `commit`.

    An object smaller than one part goes up as a single `PutObject` at `commit`. A larger one
    starts a multipart upload when its first part is full; at most `max_requests` parts are in
    flight (the writer waits for the oldest beyond that), `commit` completes the upload and
    `abort` aborts it, so no part lingers. A killed process leaves the upload unfinished and
    invisible; `zerosafe clean` finds and aborts it.
    """

    def __init__(
        self, fs: Any, url: str, path: str, counter: Any, settings: TransferSettings
    ) -> None:
        self.url = url
        self.bytes_written = 0
        self._fs = fs
        self._counter = counter
        self._bucket, self._key, _ = fs.split_path(path)
        self._path = path
        self._max_inflight = settings.max_requests
        self._part_bytes = settings.part_bytes
        self._buf = bytearray()  # grows to one part; small objects stay small
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._inflight: deque[tuple[int, concurrent.futures.Future[Any]]] = deque()
        self._next_part = 1
        self._done = False

    @property
    def num_parts(self) -> int:
        """Parts uploaded so far (0 for a single `PutObject`)."""
        return self._next_part - 1

    def _call(self, method: str, **kwargs: Any) -> Any:
        with translated_errors(self.url, "write"):
            return self._fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)

    def write(self, data: bytes | memoryview) -> None:
        assert not self._done, "sink already closed"
        view = memoryview(data).cast("B")
        try:
            while view:
                n = min(len(view), self._part_bytes - len(self._buf))
                self._buf += view[:n]
                view = view[n:]
                self.bytes_written += n
                if self._counter is not None:
                    self._counter.add_written(n)
                if len(self._buf) == self._part_bytes:
                    self._send_part()
        except BaseException:
            self.abort()
            raise

    def _send_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        while len(self._inflight) >= self._max_inflight:
            self._collect_oldest()
        body = bytes(self._buf)
        self._buf.clear()
        number = self._next_part
        self._next_part += 1
        if number > MAX_PARTS:
            raise StorageError(
                f"{self.url}: more than {MAX_PARTS} parts; raise the `part_size` storage option"
            )
        coro = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        self._inflight.append((number, asyncio.run_coroutine_threadsafe(coro, self._fs.loop)))
        if number % PARTS_PER_SIZE_STEP == 0:  # keep any size within S3's 10,000 parts
            self._part_bytes *= 2

    def _collect_oldest(self) -> None:
        number, future = self._inflight.popleft()
        with translated_errors(self.url, "write"):
            response = future.result()
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def commit(self) -> None:
        assert not self._done, "sink already closed"
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send_part()  # the last part may be smaller than 5 MiB
                while self._inflight:
                    self._collect_oldest()
                self._call(
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": sorted(self._parts, key=lambda p: p["PartNumber"])},
                )
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._buf = bytearray()
        with contextlib.suppress(Exception):
            self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        for _, future in self._inflight:
            with contextlib.suppress(BaseException):
                future.result(timeout=60)
        self._inflight.clear()
        if self._upload_id is not None:
            try:
                self._fs.call_s3(
                    "abort_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                )
            except Exception as e:  # the upload stays; `zerosafe clean` removes it later
                log.warning(
                    "%s: could not abort multipart upload (%s); `zerosafe clean` removes it",
                    self.url,
                    type(e).__name__,
                )


# -- leftover uploads ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class IncompleteUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    url: str
    bucket: str
    key: str
    upload_id: str
    initiated: float
    """Seconds since the epoch."""
    size_bytes: int
    """Bytes its uploaded parts hold (what S3 keeps billing)."""
    num_parts: int


def _paginate(fs: Any, method: str, result_key: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
    paginator_args = dict(kwargs)
    while True:
        page = fs.call_s3(method, **paginator_args)
        yield from page.get(result_key, [])
        if not page.get("IsTruncated"):
            return
        if method == "list_multipart_uploads":
            paginator_args["KeyMarker"] = page["NextKeyMarker"]
            paginator_args["UploadIdMarker"] = page["NextUploadIdMarker"]
        else:
            paginator_args["PartNumberMarker"] = page["NextPartNumberMarker"]


def list_incomplete_uploads(fs: Any, url: str) -> list[IncompleteUpload]:
    """Unfinished multipart uploads whose key starts with `url`'s key, with their part sizes."""
    bucket, prefix, _ = fs.split_path(url)
    out = []
    with translated_errors(url, "list uploads"):
        for upload in _paginate(
            fs, "list_multipart_uploads", "Uploads", Bucket=bucket, Prefix=prefix
        ):
            parts = list(
                _paginate(
                    fs,
                    "list_parts",
                    "Parts",
                    Bucket=bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
            )
            out.append(
                IncompleteUpload(
                    url=f"s3://{bucket}/{upload['Key']}",
                    bucket=bucket,
                    key=upload["Key"],
                    upload_id=upload["UploadId"],
                    initiated=upload["Initiated"].timestamp(),
                    size_bytes=sum(int(p.get("Size", 0)) for p in parts),
                    num_parts=len(parts),
                )
            )
    return out


def abort_upload(fs: Any, upload: IncompleteUpload) -> None:
    """Abort one unfinished upload, freeing its parts. An upload already gone is fine."""
    with translated_errors(upload.url, "abort upload"), contextlib.suppress(FileNotFoundError):
        fs.call_s3(
            "abort_multipart_upload",
            Bucket=upload.bucket,
            Key=upload.key,
            UploadId=upload.upload_id,
        )
