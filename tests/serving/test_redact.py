"""serving/redact.py: the one helper that masks credentials before a URL or an error message is logged,
returned or shown."""

from __future__ import annotations

import pytest

from serving.redact import MASK, mask_text, mask_url, masked_traceback


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("http://sg:Planted-Pa55@127.0.0.1:5000/api", "http://sg:***@127.0.0.1:5000/api"),
        ("https://user:p@ss@w0rd@mlflow.example.com", "https://user:***@mlflow.example.com"),  # '@' in it
        ("http://:only-password@host/x", "http://:***@host/x"),
    ],
)
def test_a_url_password_is_masked_and_user_and_host_stay(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert mask_text(f"could not reach {url}: refused") == f"could not reach {masked}: refused"


def test_a_presigned_s3_url_loses_its_signature_and_keeps_the_rest() -> None:
    url = (
        "https://bucket.s3.amazonaws.com/models/pcb/1/model.onnx?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20240101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20240101T000000Z"
        "&X-Amz-Expires=3600&X-Amz-Security-Token=FwoGZXIvYXdzEXAMPLE&X-Amz-Signature=0123456789abcdef"
    )
    for masked in (mask_url(url), mask_text(f"GET {url} answered 403")):
        assert "AKIAEXAMPLE" not in masked and "0123456789abcdef" not in masked and "FwoGZXIv" not in masked
        assert "X-Amz-Expires=3600" in masked and "bucket.s3.amazonaws.com/models/pcb/1/model.onnx" in masked
        assert masked.count(MASK) == 3


def test_every_url_in_a_text_is_masked() -> None:
    text = "tried http://a:first-secret@h1:5000/api, then https://b:second-secret@h2/x and http://h3/?token=t0k3n"
    masked = mask_text(text)
    assert "first-secret" not in masked and "second-secret" not in masked and "t0k3n" not in masked
    assert "http://a:***@h1:5000/api" in masked and "https://b:***@h2/x" in masked and "token=***" in masked


@pytest.mark.parametrize(
    "clean",
    [
        "http://127.0.0.1:5000/api/2.0/mlflow/registered-models/alias?name=pcb&alias=champion",
        "s3://bucket/prefix/models",
        "http://user@host:8080/path",  # a user without a password is no secret
        "models:/pcb@champion",
        "no URL here, a=1 and b=2",
    ],
)
def test_text_without_credentials_is_unchanged(clean: str) -> None:
    assert mask_text(clean) == clean
    assert mask_url(clean) == clean


def test_a_masked_traceback_holds_no_password_from_any_chained_error() -> None:
    try:
        try:
            raise ConnectionError("connecting to http://sg:inner-secret@127.0.0.1:9/ failed")
        except ConnectionError as inner:
            raise RuntimeError("MLflow at http://sg:outer-secret@127.0.0.1:9 is unreachable") from inner
    except RuntimeError as exc:
        text = masked_traceback(exc)
    assert "inner-secret" not in text and "outer-secret" not in text
    assert "http://sg:***@127.0.0.1:9/" in text and "ConnectionError" in text
