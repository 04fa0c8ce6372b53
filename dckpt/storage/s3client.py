"""S3 client defaults (timeouts, retries, a deadline per request) that dckpt applies to
``s3://`` storage options wherever the user set nothing: see :func:`s3_options`.
Moved out of :mod:`dckpt.storage.fsspec_storage` (which uses it in ``make_storage``).
"""
from __future__ import annotations

import asyncio
import inspect
import logging

log = logging.getLogger(__name__)

# S3 client defaults, used where the storage options leave them unset (s3_options).
S3_CONNECT_TIMEOUT_S = 10.0
S3_READ_TIMEOUT_S = 30.0  # for the first byte of a response, and between two reads
S3_RETRIES = {"max_attempts": 3, "mode": "standard"}  # botocore's: 3 retries after the try
# A request's deadline: connect + read timeouts + its body at this (low) rate, so a
# server that accepts a connection and never answers fails the request in bounded time.
S3_MIN_RATE = 256 << 10  # bytes/s
_SESSION_CLS: list = []


def _deadline_session_cls():
    """aiobotocore's aiohttp session with a deadline on each request (None where this
    aiobotocore has no pluggable session). Why: aiohttp waits for the ``100 Continue``
    that botocore asks for on every PUT with no timeout at all, and the read timeout
    starts only once the body is sent, so a PUT to a server that accepts connections but
    never answers (frozen, overloaded, a half-dead proxy) would wait forever. A request
    past its deadline is a ReadTimeoutError, which botocore's retries handle."""
    if _SESSION_CLS:
        return _SESSION_CLS[0]
    cls = None
    try:
        from aiobotocore.config import AioConfig
        from aiobotocore.httpsession import AIOHTTPSession
        from botocore.exceptions import ReadTimeoutError

        if "http_session_cls" in inspect.signature(AioConfig.__init__).parameters:
            class DeadlineSession(AIOHTTPSession):
                async def send(self, request):
                    t = self._timeout
                    n = _body_size(request)
                    limit = ((t.sock_connect or S3_CONNECT_TIMEOUT_S)
                             + (t.sock_read or S3_READ_TIMEOUT_S) + n / S3_MIN_RATE)
                    try:
                        return await asyncio.wait_for(super().send(request), limit)
                    except asyncio.TimeoutError:
                        raise ReadTimeoutError(
                            endpoint_url=request.url,
                            error=f"no response within {limit:.0f} s") from None

            DeadlineSession.__qualname__ = DeadlineSession.__name__ = "DckptDeadlineSession"
            globals()["DckptDeadlineSession"] = cls = DeadlineSession  # picklable by name
    except Exception as e:  # an aiobotocore without these names: timeouts only
        log.debug("no request deadline for S3: %s", e)
    _SESSION_CLS.append(cls)
    return cls


def _body_size(request) -> int:
    """The bytes a botocore request sends (0 when unknown)."""
    for h in ("Content-Length", "X-Amz-Decoded-Content-Length"):
        try:
            return int(request.headers.get(h) or "")
        except (TypeError, ValueError):
            pass
    try:
        return len(request.body or b"")
    except TypeError:
        return 0


def s3_options(opts: dict) -> dict:
    """``opts`` (S3 storage options) with dckpt's client defaults wherever the user
    set nothing: botocore connect/read timeouts, its "standard" retry mode, a deadline
    per request. The endpoint and credentials are botocore's usual ones: the options
    (``endpoint_url``, ``key``/``secret``), else ``AWS_ENDPOINT_URL`` /
    ``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``... and the config files."""
    out = dict(opts)
    ck = dict(out.get("config_kwargs") or {})
    ck.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
    ck.setdefault("read_timeout", S3_READ_TIMEOUT_S)
    ck.setdefault("retries", dict(S3_RETRIES))
    session = _deadline_session_cls()
    if session is not None:
        ck.setdefault("http_session_cls", session)
    out["config_kwargs"] = ck
    return out
