"""Credential-looking strings out of text a worker wrote. Pure.

A crashed worker's log tail (terminationMessagePolicy FallbackToLogsOnError)
is copied into conditions and Events, which anyone who may read the
ModelWeights sees. SDKs log request headers, URLs with userinfo and
environment dumps when they fail, so every such text goes through `redact`
before it leaves the operator. It errs towards hiding: a lost word in an
error message costs less than a leaked key.
"""
from __future__ import annotations

import re

REDACTED = "[REDACTED]"  # "[" is in none of the patterns' value alphabets: redacting twice changes nothing

# Words that name a credential in `key=value`, `key: value`, `"key": "value"`, env dumps and query strings
# (aws_secret_access_key, HF_TOKEN, X-Amz-Security-Token, X-Amz-Signature, db_password, api-key, ...);
# not "tokenizer": `tokenizer.json: not found` is a worker's everyday error.
_KEYWORD = r"(?:secret|token(?!izer)|passw(?:or)?d|pwd|credential|signature|api[_-]?key|access[_-]?key|private[_-]?key)"
_NAME = rf"[A-Za-z0-9_.-]*{_KEYWORD}[A-Za-z0-9_.-]*"
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # user:password@ (or a token as the user) in any URL.
    (re.compile(r"(?<=://)[^/\s@'\"]+@"), f"{REDACTED}@"),
    # A header's value: "Authorization: Bearer x", "'authorization': 'token x'".
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?:(?:bearer|basic|token)\s+)?[^\s\"',;}]+"),
     rf"\1{REDACTED}"),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+"), rf"\1{REDACTED}"),
    # key=value, key: value, "key": "value" (a quoted value may hold spaces); not "NoCredentialsError: ...".
    (re.compile(rf"(?i)\b({_NAME}(?<!error)(?<!exception)(?<!warning)[\"']?\s*[:=]\s*)"
                r"(?:\"[^\"\n]*\"|'[^'\n]*'|[^\s\"',;&}]+)"), rf"\1{REDACTED}"),
    # JSON Web Tokens (a ServiceAccount token, an OIDC token), wherever they stand.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]*)?"), REDACTED),
    # AWS access key ids (AKIA: long-term, ASIA: temporary, and the other IAM unique-id prefixes).
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{16}\b"), REDACTED),
    # Hugging Face user and organisation tokens.
    (re.compile(r"\b(?:hf|api_org)_[A-Za-z0-9]{20,}\b"), REDACTED),
    # A long base64 or hex run shortly after a credential word ("secret key is wJalr...", "token expired: 9f8e...").
    (re.compile(rf"(?i)(\b{_NAME}\b[^\n]{{0,40}}?)(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{{32,}}={{0,2}}(?![A-Za-z0-9+/=])"),
     rf"\1{REDACTED}"),
]


def redact(text: str) -> str:
    """`text` with every credential-looking string replaced by [REDACTED]."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text
