"""Our SigV4 presigner (trainyard/storage/sigv4.py) signs what the MinIO SDK signs, and
more: the S3 server's verdicts on its URLs are in tests/control_plane/test_storage_grants.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from minio import Minio

from trainyard.storage.sigv4 import presign

WHEN = datetime(2026, 12, 4, 17, 30, 5, tzinfo=UTC)


@pytest.mark.parametrize("key", ["jobs/a/checkpoints/step-000000010/attempt-0001/rank-00000.pt", "a b+c/é~d.pt"])
@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_host_only_urls_are_the_minio_sdks(key: str, method: str) -> None:
    sdk = Minio("127.0.0.1:8333", access_key="AKID", secret_key="s3cr3t", secure=False, region="us-east-1")
    theirs = sdk.get_presigned_url(method, "bucket-1", key, expires=timedelta(seconds=300), request_date=WHEN)
    ours = presign(method=method, endpoint="127.0.0.1:8333", bucket="bucket-1", key=key, access_key="AKID",
                   secret_key="s3cr3t", region="us-east-1", expires_s=300, now=WHEN)
    assert ours == theirs


def test_signed_headers_and_query_are_named_and_change_the_signature() -> None:
    def url(**kw: object) -> str:
        args: dict = {"method": "PUT", "endpoint": "s3.example:443", "bucket": "b-1", "key": "k", "access_key": "AKID",
                      "secret_key": "s3cr3t", "region": "eu-west-1", "expires_s": 60, "secure": True, "now": WHEN}
        return presign(**{**args, **kw})

    plain, create_only = url(), url(headers={"If-None-Match": "*"})
    assert plain.startswith("https://s3.example/b-1/k?")  # the default port is not part of the host
    assert "X-Amz-SignedHeaders=host&" in plain and "X-Amz-SignedHeaders=host%3Bif-none-match" in create_only
    part = url(query={"partNumber": "2", "uploadId": "u/1"})
    assert "partNumber=2" in part and "uploadId=u%2F1" in part
    signatures = {u.rsplit("X-Amz-Signature=", 1)[1] for u in (plain, create_only, part)}
    assert len(signatures) == 3
    with pytest.raises(ValueError):
        url(expires_s=0)
