"""Who may publish and subscribe where: the mosquitto ACL for edgefl.

This is the one definition of the access rules. `server.broker` writes it for a local broker and the firmware
provisioning reuses it for a broker on the field network, so both enforce exactly the same topic scheme
(docs/architecture.md, "Topics"). A site broker bridged to a central one (docs/scaling.md) carries the same topics,
and the central broker confines each site's bridge login to its own devices with `site_rules`.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The job-wide topics every device reads (server -> all devices), below ``edgefl/<job>/``.
SHARED_TOPICS = ("broadcast", "server", "model", "model/global/+")


def _check_user(what: str, name: str) -> None:
    if not name or any(ch.isspace() for ch in name):
        raise ValueError(f"{what} {name!r} cannot be used in an ACL file (empty or whitespace)")


def _check_job(job: str) -> str:
    if job != "+" and (not job or any(ch.isspace() or ch in "/#+" for ch in job)):
        raise ValueError(f"job {job!r} must be '+' or a single topic level without whitespace, '/', '#' or '+'")
    return f"edgefl/{job}"


def acl_rules(server_user: str, job: str = "+") -> str:
    """Return the text of a mosquitto `acl_file` for `server_user` and the devices of `job` ("+": every job).

    A device authenticates with its client id as username, so `pattern` lines with `%u` confine each device to its
    own `up` (write) and `down` (read) topics plus the job's `broadcast`, `server` and `model` topics. mosquitto
    applies `pattern` lines to every user and reads `topic` lines as belonging to the last `user` line, so the
    patterns come first and the server's unrestricted rule last. mosquitto warns that the shared-topic patterns lack
    %u/%c; that is intended: `topic` lines before any `user` line would apply to anonymous clients only.
    """
    _check_user("server_user", server_user)
    base = _check_job(job)
    return "\n".join(
        [
            "# edgefl ACL from server.acl.acl_rules: a device (username = client id) sees only its own topics.",
            f"pattern write {base}/c/%u/up",
            f"pattern read {base}/c/%u/down",
            *(f"pattern read {base}/{name}" for name in SHARED_TOPICS),
            "",
            f"user {server_user}",
            "topic readwrite edgefl/#",
            "",
        ]
    )


def site_rules(site_user: str, devices: Iterable[str], job: str = "+") -> str:
    """The ACL section that lets a site's bridge login carry its own devices' topics on the central broker, no others.

    Appended after `acl_rules`: the bridge writes each device's `up` and reads its `down` plus the shared topics,
    so a site (or whoever holds its password) can neither speak for nor listen to a device of another site.
    """
    _check_user("site_user", site_user)
    base = _check_job(job)
    lines = [f"# site {site_user}: its bridge carries these devices only", f"user {site_user}"]
    for device in devices:
        _check_user("device", device)
        lines += [f"topic write {base}/c/{device}/up", f"topic read {base}/c/{device}/down"]
    lines += [f"topic read {base}/{name}" for name in SHARED_TOPICS]
    return "\n".join([*lines, ""])
