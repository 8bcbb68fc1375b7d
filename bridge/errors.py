"""The bridge's error shape, the gRPC status -> HTTP status mapping, and the app's error handlers.

Every error leaves the bridge as `{"error": {"message", "type", "code", "param"}}`,
the OpenAI error shape, whether it came from the gRPC service (`from_grpc`), from request
validation (`validation_error`), or from the bridge itself; `add_exception_handlers` makes the
app answer every exception so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# gRPC status -> HTTP status; anything not listed is a 500.
HTTP_STATUS_OF_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}

# HTTP status -> the error's `type` (OpenAI's names where it has one).
ERROR_TYPE_OF_HTTP: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

# Retry-After when a RESOURCE_EXHAUSTED or UNAVAILABLE status carries no `retry-after` metadata
# (UNAVAILABLE: the engine is loading, draining, restarting, or unreachable).
DEFAULT_RETRY_AFTER_S = 1
# Trailing metadata of an INVALID_ARGUMENT naming the offending request field -> the error's `param`.
INVALID_FIELD = "invalid-field"
# Trailing metadata of an error with a more precise code than its status (generate.proto:
# "model_not_found" for an adapter that is not loaded or that the key may not use) -> the error's `code`.
ERROR_CODE = "error-code"
RETRY_AFTER_STATUSES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class ApiError(Exception):
    """An error the bridge answers with: HTTP status, JSON body, extra headers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.type = type
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type or ERROR_TYPE_OF_HTTP.get(self.status_code, "internal_error"),
                "code": self.code,
                "param": self.param,
            }
        }

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def retry_after_s(metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """Whole seconds from a `retry-after` metadata entry (rounded up, at least 1)."""
    for key, value in metadata or ():
        if key.lower() != "retry-after":
            continue
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        try:
            seconds = float(value)
        except ValueError:
            break
        if math.isfinite(seconds):
            return max(1, math.ceil(seconds))
        break
    return DEFAULT_RETRY_AFTER_S


def from_grpc(err: grpc.aio.AioRpcError) -> ApiError:
    """Translate a failed gRPC call into the bridge's error: HTTP status by `HTTP_STATUS_OF_GRPC`
    (a CANCELLED counts as UNAVAILABLE: 503), `Retry-After` from `retry-after` metadata, `param`
    from an INVALID_ARGUMENT's `invalid-field` metadata (`model` for a `model_not_found`), `code`
    from `error-code` metadata, else the status's name (generate.proto)."""
    status = err.code()
    message = err.details() or status.name.lower().replace("_", " ")
    if status == grpc.StatusCode.CANCELLED:
        # The bridge cancels a call only when its own client has gone, and then answers nothing;
        # a CANCELLED it reads came from the service, whose server cancels the calls in flight
        # as it stops (after an engine failure, or at the end of a drain): retry elsewhere/later.
        status, message = grpc.StatusCode.UNAVAILABLE, "the generation service stopped during the call; retry"
    http_status = HTTP_STATUS_OF_GRPC.get(status, 500)
    headers = {}
    if status in RETRY_AFTER_STATUSES:
        headers["Retry-After"] = str(retry_after_s(err.trailing_metadata()))
    param = None
    trailing = err.trailing_metadata() or ()
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        param = next((str(v) for k, v in trailing if k.lower() == INVALID_FIELD), None)
    code = next((str(v) for k, v in trailing if k.lower() == ERROR_CODE), status.name.lower())
    if code == "model_not_found":
        param = "model"                 # the REST field that names the model or adapter
    return ApiError(http_status, message, code=code, param=param, headers=headers)


def client_field(field: str, names: Mapping[str, str]) -> str:
    """An engine field (a gRPC GenerateRequest field, possibly with a path: ``choice[0]``,
    ``messages[2].content``) as the field the client sent: the longest name in `names` (engine
    field -> REST field) that is `field` or starts it, followed by ``[`` or ``.``, replaced by its
    REST field (``guided_choice[0]``, ``structured_outputs.choice[0]``); else `field` as is."""
    for engine in sorted(names, key=len, reverse=True):
        if field == engine or (field.startswith(engine) and field[len(engine)] in "[."):
            return names[engine] + field[len(engine):]
    return field


def rename_param(error: ApiError, names: Mapping[str, str]) -> None:
    """Make an error from the engine name the client's field (`client_field`): its `param`, and
    the field its message starts with (the engine writes ``"<field>: <reason>"``)."""
    if not error.param or not names:
        return
    renamed = client_field(error.param, names)
    if renamed != error.param:
        if error.message.startswith(error.param):
            error.message = renamed + error.message[len(error.param):]
        error.param = renamed


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 naming the offending field(s), from pydantic/FastAPI validation errors."""
    messages: list[str] = []
    params: list[str] = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ())]
        if loc and loc[0] in ("body", "query"):
            loc = loc[1:]
        path = ".".join(loc)
        kind = err.get("type", "")
        if kind == "json_invalid":
            messages.append(f"request body is not valid JSON: {err.get('msg', '')}")
            continue
        if kind == "extra_forbidden":
            messages.append(f"unknown field '{path}'")
        elif kind == "missing" and not path:
            messages.append("a JSON request body is required")
        elif path:
            messages.append(f"invalid value for '{path}': {err.get('msg', 'invalid')}")
        else:
            messages.append(f"invalid request body: {err.get('msg', 'invalid')}")
        if loc:
            params.append(loc[0])
    message = "; ".join(dict.fromkeys(messages)) or "invalid request"
    return ApiError(400, message, code="invalid_argument", param=params[0] if params else None)


def add_exception_handlers(app: FastAPI) -> None:
    """Make `app` answer every error as `{"error": {...}}`: an ApiError as it is, a validation
    error as `validation_error`'s 400, Starlette's HTTP errors (404, 405) with their status, and
    anything else as a 500 (logged)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc.errors()).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    err = ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
    return err.response()


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in the bridge")
    return ApiError(500, f"internal error: {type(exc).__name__}", code="internal").response()
