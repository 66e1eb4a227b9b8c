"""The API's errors: `APIError` (an HTTP status and OpenAI's error object, or a gRPC status:
router/grpc_api.py), and how a body that fails its request schema becomes one."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class APIError(Exception):
    """An error the client caused or must see, with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple:  # crosses processes whole (Serve carries it to its gRPC proxy)
        return (APIError, (self.status, self.message, self.type, self.param, self.code, self.headers))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def validation_message(exc: Any) -> tuple[str, str | None]:
    """A pydantic ValidationError as (message, param) without echoing the client's input."""
    errs = exc.errors(include_input=False, include_url=False)
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(p) for p in first.get("loc", ()))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc or 'body'}: {first.get('msg', 'invalid')}{more}", (loc or None)


def parse_body(model: Any, body: Any) -> Any:
    """A JSON body as the request schema `model`, or a 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param=param) from None
