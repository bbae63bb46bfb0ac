"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a bare 500.

Every failure the gateway knows about is an `APIError`; FastAPI's request-validation errors are
rewritten to name the offending field the way OpenAI does (`messages[0].role`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """A failure with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param or None, code=code)


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union-branch names are dropped."""
    path = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_branch_tag(part):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def _is_branch_tag(part: Any) -> bool:
    # pydantic names union branches in locations: 'str', 'list[int]', 'function-after[...]'
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """The first problem as (param, message): the field a client must fix."""
    errors = exc.errors()
    if not errors:
        return "", "invalid request body"
    first = errors[0]
    param = field_path(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return "", f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}"
    if first.get("type") == "model_attributes_type" or (not param and first.get("type") == "dict_type"):
        return "", "request body must be a JSON object"
    alternatives = [
        _relative(path, param) + str(e.get("msg"))
        for e in errors[1:]
        if _is_under(path := field_path(e.get("loc", ())), param)
    ]
    if alternatives:  # a union field (prompt, stop, content): say what each accepted form wanted
        msg = "matches none of the accepted forms: " + "; ".join(dict.fromkeys([msg, *alternatives]))
    return param, msg


def _is_under(path: str, param: str) -> bool:
    return path == param or path.startswith((param + ".", param + "["))


def _relative(path: str, param: str) -> str:
    """'messages[0].content[0].type' under 'messages[0].content' -> '[0].type: '."""
    rest = path[len(param) :].lstrip(".")
    return f"{rest}: " if rest else ""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        param, msg = validation_message(exc)
        return bad_request(param, msg).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
