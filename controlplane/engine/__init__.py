"""The engine loop and what it drives: the loop itself (schedule, send, fold results back,
wake requests), its settings, what it does when the data plane is lost or a step fails, the
steps in flight, the step protocol's codec and the client of one worker group, speculative
decoding's control side, sizing from the workers' reports, telemetry and profiling."""
