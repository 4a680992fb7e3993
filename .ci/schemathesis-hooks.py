"""Schemathesis hooks for the payments example (run by .ci/schemathesis).

An Idempotency-Key binds its first request: the same key with another request (another body,
method or path) is answered 422 `urn:idem:problem:key-mismatch`, by design. Schemathesis draws keys
from the key's schema and so reuses one (its example, say) across different requests, and a
schema-valid request would then be refused for a reason no schema can state. So a valid key is sent
as drawn on its first request, which is what tests idem's grammar, and a later, different request
drawn with the same key gets a fresh key instead. A key outside the grammar is sent as drawn.
"""

import re
import threading
import uuid
from collections.abc import MutableMapping

import schemathesis

# idem_runtime::openapi::KEY_PATTERN (tests/tests/http/key_schema.rs checks it against the parser).
KEY = re.compile(r'^(?:[!#-+\--~][!-+\--~]{0,254}|"(?:[!#-\[\]-~]|\\["\\]){1,255}")$')

_lock = threading.Lock()
_first_request = {}


def _header(headers, name):
    return next((n for n in headers if isinstance(n, str) and n.lower() == name), None)


@schemathesis.hook
def before_call(context, case, **kwargs):
    headers = case.headers
    if not isinstance(headers, MutableMapping):
        return
    name = _header(headers, "idempotency-key")
    key = headers.get(name) if name else None
    if not isinstance(key, str) or not KEY.fullmatch(key):
        return
    # `"abc"` and `abc` are one key.
    if key.startswith('"'):
        key = re.sub(r'\\(.)', r'\1', key[1:-1])
    auth = _header(headers, "authorization")
    request = (
        case.method.upper(),
        case.formatted_path,
        case.media_type,
        repr(case.body),
        headers.get(auth) if auth else None,
    )
    with _lock:
        first = _first_request.setdefault(key, request)
    if first != request:
        headers[name] = uuid.uuid4().hex
