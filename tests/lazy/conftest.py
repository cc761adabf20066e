"""Fixtures for the lean-resume tests: the S3 server on loopback (moto), from the S3 suite."""

from __future__ import annotations

from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
