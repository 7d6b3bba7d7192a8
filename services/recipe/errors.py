"""Every error the recipe raises, and the one mapping from a refusal to the client's own error format.

Two kinds reach a client:
    ConversionError / FieldRefusal   a request the recipe refuses (status + message); `api_error` formats it
    ApiError                         a refusal already formatted for the API that sent it (`error_for`)
The rest are raised inside one layer and turned into a ConversionError (or a CLI reply) by its caller:
    BodyError      the body does not have the API's shape (serde's words)       convert/serde.py readers
    SchemaError    a client JSON schema fails the meta-schema                    convert/schema.py
    StrictError    a strict-mode schema cannot be normalized                     convert/strict.py
    TemplateError  a model's chat template refused the conversation              chat_template.py
    MissingToken   a control token of the prompt has no id in the tokenizer      formats/deepseek_tokenizer.py
    BadInput       the offline `parse` CLI got unusable stdin                    cli_parse.py

This module imports nothing of the recipe, so every layer (formats/, convert/, the service) can raise these
without importing another layer.
"""

from __future__ import annotations

from shared.api_errors import anthropic_error_body, openai_error_body

# --- refusals the client sees --------------------------------------------------------------------------------


class ConversionError(Exception):
    """A request the reference refuses: `status` and `message` are exactly its own; the API adapter wraps them
    in its error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class FieldRefusal(ConversionError):
    """A 400 the reference does not give, about one request feature: a field we read and it does not (a vLLM
    extension with a bad value) or one neither side honours that we refuse instead of dropping (prompt_logprobs,
    penalties, image input...). Raised only after every check the reference makes, so a request it refuses
    is still refused in its words. `field` is the top-level body field at fault (the client's `param`), or
    None when the fault is inside the content (an image part)."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message, 400)
        self.field = field


class ApiError(Exception):
    """A refusal already formatted for the client that sent it: `body` is the API's own error JSON."""

    def __init__(self, status: int, body: bytes, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = message


# --- errors inside one layer ---------------------------------------------------------------------------------


class BodyError(ValueError):
    """The body does not have the API's shape; `message` is serde's (without the "invalid request body: ")."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SchemaError(ValueError):
    """A client JSON schema violates the meta-schema; the message is the reference validator's."""


class StrictError(ValueError):
    """`shape` errors come from reading the schema (the caller prefixes them), rule errors are final."""

    def __init__(self, message: str, *, shape: bool) -> None:
        super().__init__(message)
        self.message = message
        self.shape = shape


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or could not render it: a 400 for the client."""


class MissingToken(ValueError):
    """A control token of the prompt has no id in this tokenizer."""


class BadInput(Exception):
    """The offline `parse` CLI's stdin cannot be used; answered in the API's error format with `status`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


# --- the API error shapes ------------------------------------------------------------------------------------


def openai_error(
    status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None
) -> ApiError:
    return ApiError(status, openai_error_body(status, message, param=param, code=code, kind=kind), message)


def anthropic_error(status: int, message: str) -> ApiError:
    return ApiError(status, anthropic_error_body(status, message), message)


def error_for(
    api: str, status: int, message: str, *, code: str | None = None, param: str | None = None,
    kind: str | None = None,
) -> ApiError:
    """An error in the API's own format: Anthropic's for Messages, OpenAI's for the rest (with the field at
    fault as `param`, where known, and `kind` as the `type` when given)."""
    if api == "messages":
        return anthropic_error(status, message)
    return openai_error(status, message, param=param, code=code, kind=kind)


def api_error(api: str, error: ConversionError) -> ApiError:
    """The refusal in the API's own error format (OpenAI's for chat, completions and responses)."""
    param = error.field if isinstance(error, FieldRefusal) else None
    return error_for(api, error.status, error.message, code="invalid_request_error", param=param)
