"""What crosses MQTT: the messages and how each field is declared and bounded (``messages``, ``schema``),
the plan a strategy sends one device (``plan``: it travels as it is, inside the assignment), the framing and its
errors (``protocol``), the update codecs (``codecs``), chunked transfer (``chunking``), the topic scheme
(``topics``) and the MQTT link both halves use (``transport``).

The server and the device speak through these modules alone, so they import no other room of ``edge_client``:
only ``edge_client.secagg``'s sizes and bounds (``secagg.wire``, ``secagg.shamir``), which the secure aggregation
messages declare. The device loop, the models and the algorithms build on the wire, never the reverse.
"""
