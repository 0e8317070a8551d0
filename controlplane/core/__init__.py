"""The engine core (issue 18): the one process that owns the queue, the scheduling policy, the
block tables and the step pipeline to the data planes, serving the API front ends over
``headrace.core.v1.EngineCore``."""
