"""An API front end (issue 18): the public services (Inference, Admin proxied to the core,
health, reflection, the OpenAI-compatible HTTP API) over a ``CoreClient``; N of them share the
public ports beside one engine core."""
