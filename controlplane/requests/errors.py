"""The request path's refusal: ``ValidationError`` names the field a request got wrong, before
any work is done; the services answer it with INVALID_ARGUMENT (gRPC) or 400 (HTTP). Its own
module so that the checks of every part of a request (``validation``, structured outputs'
``spec``, chat input) raise the one class without importing each other."""

from __future__ import annotations


class ValidationError(ValueError):
    pass
