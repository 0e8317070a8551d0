"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn, in the control plane's event loop):
``server`` runs it, ``app`` routes and authenticates, ``protocol`` holds the request models,
``convert`` turns them into ``GenerateRequest``s, ``streaming`` writes SSE and whole responses,
``timeouts`` closes connections whose headers trickle in.
Every generation goes through ``headrace.controlplane.requests.path``, as gRPC's does."""
