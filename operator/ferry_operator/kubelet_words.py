"""What the kubelet, the scheduler and registries say about a pod, and how to
quote it in a condition: pure patterns shared by the prepare Jobs' diagnosis
(executors/diagnosis.py) and the serving pods' (serving/diagnosis.py)."""
from __future__ import annotations

import re

from .executors.redact import redact

MAX_LINE = 500

# The registry answered: no such image or tag, or no access to it. Retrying will not change that.
REGISTRY_REFUSED = re.compile(
    r"code = NotFound|: not found|manifest unknown|name unknown|repository does not exist|pull access denied|"
    r"unauthorized|authentication required|authorization failed|insufficient_scope|\bdenied\b|403 Forbidden",
    re.IGNORECASE,
)
# CreateContainerConfigError's message for a reference that does not exist.
MISSING_REFERENCE = re.compile(r'^(secret|configmap) "([^"]+)" not found$')
# ... and for a required secretKeyRef whose Secret lacks the key (kubelet_pods.go).
MISSING_SECRET_KEY = re.compile(r"^couldn't find key (\S+) in Secret [^/\s]+/(\S+)$")
# The kubelet's waiting reasons of a failed image pull that it retries.
PULL_RETRIED = ("ErrImagePull", "ImagePullBackOff", "RegistryUnavailable", "SignatureValidationFailed",
                "ImageInspectError")


def last_line(text: str | None) -> str:
    """The last line of a message, redacted before it is cut (a cut key would escape its pattern)."""
    lines = [line.strip() for line in redact(text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


# A line that reads as an error: an exception, a log line at ERROR/FATAL/CRITICAL, a Go panic.
ERROR_LINE = re.compile(r"^\w*(Error|Exception|Exit)\b|\b(ERROR|FATAL|CRITICAL)\b|^panic:|Traceback|error:",
                        re.IGNORECASE)


def error_line(text: str | None) -> str:
    """The last line of a message that reads as an error, else its last line (redacted, cut). A container's
    stdout and stderr reach its log through two pipes, so an info line written before the error can land
    after it; and vLLM logs shutdown lines after its error. The error is what a human needs."""
    lines = [line.strip() for line in redact(text or "").splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if ERROR_LINE.search(line)), lines[-1] if lines else "")
    return found if len(found) <= MAX_LINE else found[: MAX_LINE - 3] + "..."
