"""Masking secrets before anything is printed, logged or returned: the one helper the server, the stack
and the flows use for URLs with credentials (``scheme://user:password@host``) and secret-looking query
parameters. The model server imports nothing from the platform, so the helper lives here, at the bottom.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# Query parameters whose value is a credential (pre-signed S3 URLs, tokens in links).
_SECRET_PARAMS = re.compile(
    r"(password|passwd|pwd|secret|token|signature|x-amz-signature|x-amz-credential|x-amz-security-token|"
    r"api[-_]?key|access[-_]?key|sig)$",
    re.IGNORECASE,
)
# A URL's userinfo with a password, anywhere in a text: scheme://user:password@. Greedy up to the last
# '@' before the path: an unencoded '@' in a password must not leave its tail in clear; two URLs on one
# line are apart by whitespace, which the password cannot hold.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s:/@]*):(?P<password>[^\s/]+)@")
_QUERY_SECRET = re.compile(
    r"(?P<key>[?&](?:password|passwd|pwd|secret|token|api[-_]?key|access[-_]?key|"
    r"x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig)=)(?P<value>[^&\s#\"']+)",
    re.IGNORECASE,
)


def mask_url(url: str) -> str:
    """The URL with its password and secret query values replaced by ``***`` (user and host stay, so the
    message still says where). Not a URL: returned through ``mask_text``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return mask_text(url)
    if not parts.scheme or not parts.netloc:
        return mask_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if _SECRET_PARAMS.match(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def mask_text(text: str) -> str:
    """Every URL password and secret query value in a free text (an error message, a log line) masked."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", text)


_installed = False


def install_log_masking() -> None:
    """Mask credentials in every log record this process makes from now on, whoever logs it (our modules,
    Prefect, MLflow, botocore, httpx), on every handler (files, stderr, Prefect's API handler).

    A record factory rather than a handler filter: filters sit on handlers, and handlers come and go
    (Prefect adds its API handler per run); the factory sees each record once, when it is made. Records
    whose message has no URL or ``key=`` pair cost one substring test.
    """
    global _installed
    if _installed:
        return
    make = logging.getLogRecordFactory()

    def masked(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as it would have
            return record
        clean = mask_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            # The traceback's last line holds the exception's message, which often names a URL.
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            clean = mask_text(text)
            if clean != text:
                record.exc_text, record.exc_info = clean, None
        return record

    logging.setLogRecordFactory(masked)
    _installed = True


def masked_traceback(exc: BaseException) -> str:
    """``exc``'s traceback with its chained causes, every message in it through ``mask_text``: what a
    log may show of an exception from an HTTP or S3 client, whose message often holds the URL."""
    return mask_text("".join(traceback.format_exception(exc)).rstrip())
