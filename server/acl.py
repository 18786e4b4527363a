"""Who may publish and subscribe where: the mosquitto ACL for edgefl.

This is the one definition of the access rules. `server.broker` writes it for a local broker and the firmware
provisioning reuses it for a broker on the field network, so both enforce exactly the same topic scheme
(docs/architecture.md, "Topics").
"""

from __future__ import annotations


def acl_rules(server_user: str, job: str = "+") -> str:
    """Return the text of a mosquitto `acl_file` for `server_user` and the devices of `job` ("+": every job).

    A device authenticates with its client id as username, so `pattern` lines with `%u` confine each device to its
    own `up` (write) and `down` (read) topics plus the job's `broadcast`, `server` and `model` topics. mosquitto
    applies `pattern` lines to every user and reads `topic` lines as belonging to the last `user` line, so the
    patterns come first and the server's unrestricted rule last. mosquitto warns that the shared-topic patterns lack
    %u/%c; that is intended: `topic` lines before any `user` line would apply to anonymous clients only.
    """
    if not server_user or any(ch.isspace() for ch in server_user):
        raise ValueError(f"server_user {server_user!r} cannot be used in an ACL file (empty or whitespace)")
    if job != "+" and (not job or any(ch.isspace() or ch in "/#+" for ch in job)):
        raise ValueError(f"job {job!r} must be '+' or a single topic level without whitespace, '/', '#' or '+'")
    base = f"edgefl/{job}"
    return "\n".join(
        [
            "# edgefl ACL from server.acl.acl_rules: a device (username = client id) sees only its own topics.",
            f"pattern write {base}/c/%u/up",
            f"pattern read {base}/c/%u/down",
            f"pattern read {base}/broadcast",
            f"pattern read {base}/server",
            f"pattern read {base}/model",
            "",
            f"user {server_user}",
            "topic readwrite edgefl/#",
            "",
        ]
    )
