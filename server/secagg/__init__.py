"""The server half of secure aggregation: the round's stages over MQTT (``stages``) and the unmasking of the sum
(``unmask``). The protocol itself, shared with devices, is ``edge_client.secagg``."""
