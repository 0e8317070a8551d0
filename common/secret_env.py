"""The server's secrets, read in one place: where each comes from (its flag, else its
``HEADRACE_*`` environment variable; API tokens also from ``--api-tokens-file``), which process
role receives which (by environment only, never on a command line), and the scrubbing of a
secret given by flag from this process's own command line (what ``ps`` and
``/proc/PID/cmdline`` show).

Every server command resolves its secrets with ``resolve`` before it starts, so a flag and its
variable behave the same in every layout: ``headrace serve`` (supervisor, data plane child,
engine core, API front ends), ``headrace controlplane``, ``headrace dataplane`` and the role
commands the supervisors start. ``role_env`` gives each child only what its role uses:

- a data plane: the worker secret (it serves only callers presenting it);
- the engine core: the worker secret (it calls the data planes) and the core secret (it serves
  only its front ends, which authorise Admin callers themselves);
- an API front end: the API tokens and the admin token (it authenticates the public callers)
  and the core secret (it calls the core).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
from typing import Iterable

API_TOKEN, API_TOKENS = "HEADRACE_API_TOKEN", "HEADRACE_API_TOKENS"
ADMIN_TOKEN, WORKER_SECRET, CORE_SECRET = "HEADRACE_ADMIN_TOKEN", "HEADRACE_WORKER_SECRET", "HEADRACE_CORE_SECRET"
SECRET_VARS = (API_TOKEN, API_TOKENS, ADMIN_TOKEN, WORKER_SECRET, CORE_SECRET)
# the worker secret's file, when $HEADRACE_WORKER_SECRET is unset (docker compose makes one on
# first start: docs/operations.md); a path, not a secret, so children may inherit it
WORKER_SECRET_FILE = "HEADRACE_WORKER_SECRET_FILE"
# option dest -> its environment variable
SINGLE = {"admin_token": ADMIN_TOKEN, "worker_secret": WORKER_SECRET, "core_secret": CORE_SECRET}
ROLE_SECRETS = {"dataplane": ("worker_secret",), "core": ("worker_secret", "core_secret"),
                "frontend": ("api_token", "admin_token", "core_secret")}


def env_token_entries(environ=os.environ) -> list[str]:
    """API token entries from $HEADRACE_API_TOKENS (comma-separated; one a line when it has
    line breaks, as the supervisor passes them) and $HEADRACE_API_TOKEN."""
    many = environ.get(API_TOKENS, "")
    entries = many.splitlines() if "\n" in many else many.split(",")
    return [e for e in entries + [environ.get(API_TOKEN, "")] if e.strip()]


def api_token_entries(tokens=(), file: str | None = None, environ=os.environ) -> list[str]:
    """The API's ``[TENANT=]TOKEN`` entries: ``--api-token`` values and ``--api-tokens-file``
    lines (blank and ``#`` lines skipped), else the environment's."""
    entries = [t for t in (tokens or ()) if t.strip()]
    if file:
        entries += [line for line in pathlib.Path(file).read_text().splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    return entries or env_token_entries(environ)


def worker_secret(given: str | None = None, environ=os.environ) -> str | None:
    """The planes' shared secret: ``given`` (a flag), else ``$HEADRACE_WORKER_SECRET``, else the
    contents of the file ``$HEADRACE_WORKER_SECRET_FILE`` names; None when none is set. A named
    file that cannot be read or is empty is a ValueError (one line)."""
    if given or environ.get(WORKER_SECRET):
        return given or environ[WORKER_SECRET]
    path = environ.get(WORKER_SECRET_FILE)
    if not path:
        return None
    try:
        secret = pathlib.Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{WORKER_SECRET_FILE}={path}: cannot read it ({exc.strerror})") from None
    if not secret:
        raise ValueError(f"{WORKER_SECRET_FILE}={path}: the file is empty")
    return secret


def flag_values(args) -> list[str]:
    """The secrets this command line itself carries (to scrub from argv)."""
    values = list(getattr(args, "api_token", None) or ())
    values += [getattr(args, dest, None) for dest in SINGLE]
    return [v for v in values if isinstance(v, str) and v]


def resolve(args, environ=os.environ) -> None:
    """Fills ``args``' secrets from its flags, else the environment: ``api_token`` becomes the
    list of every entry (``--api-tokens-file`` read here, and then cleared); each single
    secret its flag's value or its variable's (None when neither; the worker secret, else
    the file ``$HEADRACE_WORKER_SECRET_FILE`` names)."""
    if hasattr(args, "api_token"):
        args.api_token = api_token_entries(args.api_token, getattr(args, "api_tokens_file", None),
                                           environ) or None
        if hasattr(args, "api_tokens_file"):
            args.api_tokens_file = None
    for dest, name in SINGLE.items():
        if hasattr(args, dest):
            setattr(args, dest, getattr(args, dest) or environ.get(name) or None)
    if hasattr(args, "worker_secret"):   # else the file $HEADRACE_WORKER_SECRET_FILE names
        args.worker_secret = worker_secret(args.worker_secret, environ)


def role_env(role: str, args, environ=os.environ) -> dict[str, str]:
    """A child's environment: ``environ`` without any secret, plus the secrets ``role`` uses
    (from the resolved ``args``). API tokens travel one a line in $HEADRACE_API_TOKENS."""
    env = {k: v for k, v in environ.items() if k not in SECRET_VARS}
    for dest in ROLE_SECRETS[role]:
        value = getattr(args, dest, None)
        if dest == "api_token":
            if value:
                env[API_TOKENS] = "\n".join(value) + "\n"
        elif value:
            env[SINGLE[dest]] = value
    return env


def _argv_region() -> tuple[int, int] | None:
    """Where the kernel keeps this process's command line (Linux: /proc/self/stat fields 48
    and 49, arg_start and arg_end)."""
    try:
        stat = pathlib.Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()   # fields from 3 on (the name may hold spaces)
        start, end = int(fields[48 - 3]), int(fields[49 - 3])
    except (OSError, ValueError, IndexError):
        return None
    return (start, end) if 0 < start < end else None


def scrub_argv(secrets: Iterable[str]) -> bool:
    """Overwrites, with ``*``, each argument of this process's command line that is one of
    ``secrets`` (or ``--flag=SECRET``), in place (same length), so ``ps`` no longer shows it.
    Linux only (elsewhere, and where the region cannot be found, False: nothing changed).
    ``sys.argv`` (Python's copy) keeps the values."""
    wanted = {s.encode() for s in secrets if s}
    region = _argv_region() if wanted else None
    if region is None:
        return False
    start, end = region
    raw = ctypes.string_at(start, end - start)
    parts = raw.split(b"\0")
    for i, part in enumerate(parts):
        flag, eq, value = part.partition(b"=")
        if part in wanted:
            parts[i] = b"*" * len(part)
        elif eq and flag.startswith(b"--") and value in wanted:
            parts[i] = flag + eq + b"*" * len(value)
    scrubbed = b"\0".join(parts)
    if scrubbed != raw:
        ctypes.memmove(start, scrubbed, len(scrubbed))
    return True
