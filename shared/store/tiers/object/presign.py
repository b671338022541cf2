"""Presigned URLs of one bucket's objects (SigV4, query-signed) at the cost of the signature alone.

Why not ``client.generate_presigned_url`` for every request: it runs boto3's whole per-call machinery before
it signs (the parameters' event handlers, the endpoint rules, the request's serialization), about 0.3 ms of
CPU on 2 cores, as much as the signature, for each of a record's GETs, HEADs and PUTs (`direct`). None of
that depends on the object: the endpoint, the addressing, the scope (region, service) and any operation
parameters of the query are the bucket's. So boto3 presigns one probe object per method when first asked,
and the URL of every object is its base with the object's name, signed by botocore's own SigV4 query signer
(`S3SigV4QueryAuth`) with the client's credentials (refreshed as boto3 refreshes them) and the scope the
probe URL names. The URL is the one boto3 gives (a test compares them byte for byte at a fixed time).

A probe URL of another shape (not SigV4, or the name not at the end of its path) leaves the method to boto3.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest

#: The object a method's first URL is presigned for (never requested: only its URL's shape is read).
PROBE_NAME = "tiercache-presign-probe"
_OPERATIONS = {"GET": "get_object", "HEAD": "head_object", "PUT": "put_object"}


class _Template:
    """What a method's URLs share: the URL up to the object's name, the query's operation parameters, the
    signing scope."""

    __slots__ = ("base", "query", "region", "service")

    def __init__(self, base: str, query: str, region: str, service: str) -> None:
        self.base, self.query, self.region, self.service = base, query, region, service


class Presigner:
    """``url(method, name, headers)``: a presigned URL of ``name`` in ``bucket`` for ``client``."""

    def __init__(self, client: Any, bucket: str, expires_s: int) -> None:
        self.client = client
        self.bucket = bucket
        self.expires_s = expires_s
        self._templates: dict[str, _Template | None] = {}
        self._lock = threading.Lock()

    def url(self, method: str, name: str, headers: dict[str, str] | None = None,
            params: dict[str, Any] | None = None) -> str:
        """The presigned URL; ``headers``: those the request will carry and the signature must cover (a PUT's
        ``x-amz-meta-*``), ``params`` the same as boto3's operation parameters (``Metadata``), for boto3's
        presigning when the template path is not taken."""
        template = self._template(method)
        credentials = getattr(getattr(self.client, "_request_signer", None), "_credentials", None)
        if template is None or credentials is None:
            return self.client.generate_presigned_url(
                _OPERATIONS[method], Params={"Bucket": self.bucket, "Key": name, **(params or {})},
                ExpiresIn=self.expires_s, HttpMethod=method)
        url = template.base + quote(name, safe="/~") + template.query
        request = AWSRequest(method=method, url=url, headers=dict(headers or {}))
        S3SigV4QueryAuth(credentials.get_frozen_credentials(), template.service, template.region,
                         expires=self.expires_s).add_auth(request)
        return request.url

    def _template(self, method: str) -> _Template | None:
        if method in self._templates:
            return self._templates[method]
        with self._lock:
            if method not in self._templates:
                probe = self.client.generate_presigned_url(
                    _OPERATIONS[method], Params={"Bucket": self.bucket, "Key": PROBE_NAME},
                    ExpiresIn=self.expires_s, HttpMethod=method)
                self._templates[method] = template_of(probe)
        return self._templates[method]


def template_of(probe_url: str) -> _Template | None:
    """A method's template from boto3's URL for the probe object; None when it is not of the shape the
    template path signs (SigV4 by query over the host header alone, the name at the end of the path, no
    fragment)."""
    parts = urlsplit(probe_url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    auth = {k: v for k, v in pairs if k.startswith("X-Amz-")}
    suffix = "/" + PROBE_NAME
    if (auth.get("X-Amz-Algorithm") != "AWS4-HMAC-SHA256" or auth.get("X-Amz-SignedHeaders") != "host"
            or not parts.path.endswith(suffix) or parts.fragment):
        return None
    scope = auth.get("X-Amz-Credential", "").split("/")  # key id / date / region / service / aws4_request
    if len(scope) != 5 or scope[4] != "aws4_request":
        return None
    operation = [(k, v) for k, v in pairs if not k.startswith("X-Amz-")]
    query = "?" + "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in operation) \
        if operation else ""
    base = urlunsplit((parts.scheme, parts.netloc, parts.path[:-len(PROBE_NAME)], "", ""))
    return _Template(base, query, scope[2], scope[3])
