"""The device owner's tools besides serving a federation: ``check`` (``edge-client check``: is this device
ready?), ``speed`` (``edge-client benchmark``: seconds per 100 local updates, inference latency) and ``fetch``
(``edge-client fetch-model``: the server's newest exported model).

They may import every other room of ``edge_client``; nothing but the command (``edge_client.cli``) imports them.
"""
