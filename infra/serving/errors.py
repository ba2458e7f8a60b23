"""What an inference server's failures look like to its callers: one error type for an
answer that is an error or unusable, one for a server that cannot be reached."""

from __future__ import annotations

import httpx

from sluice.infra.serving import protocol


class InferenceServerError(RuntimeError):
    """An inference server answered with an error or an unusable response."""

    def __init__(self, url: str, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        """Base URL of the server that failed."""
        self.status_code = status_code
        """HTTP status of the answer, when there was one."""


class InferenceServerUnreachableError(InferenceServerError):
    """No connection could be made to an inference server (or it timed out)."""


def error_message(response: httpx.Response) -> str:
    """The error an answer carries: SGLang's JSON error body, else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    return protocol.error_message(body)
