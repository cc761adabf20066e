"""The DCP reader through a real S3 server on loopback (moto): the same layout as from local
files, and no byte of the optimizer state requested."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import MotoServer, upload_folder
from zerosafe.formats.dcp.reader import is_dcp_checkpoint, read_dcp_layout
from zerosafe.io.storage import Storage


def test_layout_over_s3_equals_local(
    dcp_checkpoint: Callable[[str], Path],
    moto: MotoServer,  # noqa: F811 - fixture
    bucket: str,  # noqa: F811 - fixture
) -> None:
    local = dcp_checkpoint("fsdp2")
    url = upload_folder(moto.url, local, bucket, "dcp/fsdp2")
    storage = Storage({"endpoint_url": moto.url})
    assert is_dcp_checkpoint(url, storage)
    remote = read_dcp_layout(url, storage)
    here = read_dcp_layout(str(local), Storage())
    assert [f.url.rsplit("/", 1)[1] for f in remote.files] == [
        f.url.rsplit("/", 1)[1] for f in here.files
    ]
    assert [(s.byte_offset, s.numel, s.dtype) for s in remote.slots] == [
        (s.byte_offset, s.numel, s.dtype) for s in here.slots
    ]
    for a, b in zip(remote.tensors.values(), here.tensors.values(), strict=True):
        assert (a.name, a.shape, a.dtype, a.fragments) == (b.name, b.shape, b.dtype, b.fragments)
    assert remote.source.content_sha256 == here.source.content_sha256
    # Headers only: a few small ranged reads per chunk, never the data of optimizer chunks.
    read = storage.counter.bytes_read
    assert read < sum(s.nbytes for s in here.slots) + 40_000
