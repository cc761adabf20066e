"""Fixtures for the pt2st tests: the shared Prefect test server and the S3 server on loopback
(moto), reused from the flow and S3 test suites."""

from __future__ import annotations

from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
