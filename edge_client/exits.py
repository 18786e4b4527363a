"""`edge-client`'s exit statuses: what happened, so that a service manager restarts the cases a restart can fix.

The values follow sysexits.h where it has one. The systemd unit (firmware_scripts/edgefl-client.service.in) restarts
on failure except for ``NO_RESTART``: a wrong password or a wrong setting fails the same way every time, until a person
fixes it (then ``systemctl restart edgefl-client``).
"""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    FINISHED = 0
    ERROR = 1
    USAGE = 2
    UNAVAILABLE = 69  # EX_UNAVAILABLE
    REFUSED = 77  # EX_NOPERM
    CONFIG = 78  # EX_CONFIG
    INTERRUPTED = 130


MEANING = {
    ExitStatus.FINISHED: "finished (--once: the run ended; --max-rounds reached; SIGTERM)",
    ExitStatus.ERROR: "an unexpected error (the traceback says where)",
    ExitStatus.USAGE: "the command line is wrong",
    ExitStatus.UNAVAILABLE: "no answer from the broker at start (down, unreachable, wrong address)",
    ExitStatus.REFUSED: "the broker refused the login (wrong username or password, or a revoked device)",
    ExitStatus.CONFIG: "a setting is wrong (data file, broker URL, client id, password file), or the server refused "
    "this device's model (the log names the parameter that differs)",
    ExitStatus.INTERRUPTED: "interrupted (Ctrl-C)",
}

#: What a restart cannot fix (the unit's RestartPreventExitStatus=).
NO_RESTART = (ExitStatus.USAGE, ExitStatus.REFUSED, ExitStatus.CONFIG)


def describe() -> str:
    """One line per status, for ``--help``."""
    return "exit status:\n" + "\n".join(f"  {int(s):>3}  {text}" for s, text in MEANING.items())
