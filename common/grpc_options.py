"""The gRPC settings of every server and channel headrace opens, in one place: message size
limits, keepalive (both ends agree: a client pings no more often than a server accepts) and
the reconnect backoff of the control plane's channels to its data planes."""

from __future__ import annotations

from headrace.common import net

# Message size limits. The public API receives at most the largest valid request of the model
# it serves, computed at server start (``headrace.controlplane.requests.limits.max_request_bytes``: the text a
# max_model_len prompt can be, or its token ids, plus fixed overhead) and given to
# ``server_options``; it sends up to PUBLIC_MAX_SEND_BYTES (a Tokenize answer of a long text).
# The step protocol carries whole prompts and block tables of a step's new sequences; the
# private stream between the API front ends and the engine core carries batches of submissions
# (token ids) and of every new token of a step.
PUBLIC_MAX_SEND_BYTES = 64 << 20
STEP_MAX_MESSAGE_BYTES = 256 << 20
CORE_MAX_MESSAGE_BYTES = 256 << 20

KEEPALIVE_TIME_MS = 30_000      # ping a connection idle this long (dead peers, idle NATs)
KEEPALIVE_TIMEOUT_MS = 10_000   # and drop it when the ping goes unanswered this long
MIN_PING_INTERVAL_MS = 5_000    # a server accepts a client's pings this often at most

# The public server's receive window per stream. gRPC's BDP probing grows a connection's windows
# to megabytes within a few round trips, so a client that sends an oversized (or unauthenticated)
# message gets that much of it buffered in the server before the call is refused: 32 concurrent
# 30 MiB calls grew the control plane by 4-250 MiB (tests/test_hostile_load.py). With probing off
# and a fixed 1 MiB window, the same calls grow it by 0-7 MiB. The cost is upload speed over a
# long round trip: a prompt moves at most 1 MiB a round trip (a 128k-token prompt's ~0.5 MiB of
# text: one). The private links (step protocol, engine core) keep probing: their peers are ours.
PUBLIC_RECEIVE_WINDOW_BYTES = 1 << 20

# reconnect quickly to a data plane that is still starting or restarting
RECONNECT_BACKOFF_MS = (100, 1000)   # first and longest


def _common(max_message_bytes: int, max_send_bytes: int | None = None) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_send_bytes or max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1)]


def server_options(max_message_bytes: int, max_send_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options of a gRPC server (either plane's): it receives messages up to
    ``max_message_bytes`` and sends up to ``max_send_bytes`` (default the same); its port is
    its own (``headrace.common.net``)."""
    return _common(max_message_bytes, max_send_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),   # never close a connection for its pings
        net.GRPC_EXCLUSIVE_PORT,              # a port in use fails the bind
    ]


def public_server_options(max_message_bytes: int,
                          max_send_bytes: int = PUBLIC_MAX_SEND_BYTES) -> list[tuple[str, int]]:
    """Options of the public API server: ``server_options`` with a fixed receive window per
    stream (no BDP probing), so a message the server will refuse cannot fill its memory first."""
    return server_options(max_message_bytes, max_send_bytes) + [
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", PUBLIC_RECEIVE_WINDOW_BYTES),
    ]


def channel_options(max_message_bytes: int = STEP_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options of a channel from the control plane to a data plane."""
    first, longest = RECONNECT_BACKOFF_MS
    return _common(max_message_bytes) + [
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", longest),
    ]
