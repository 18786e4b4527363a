"""Differential privacy (docs/privacy.md): the budget (``accountant``), the settings checked at load (``settings``) and
the mechanism around a strategy's aggregation (``mechanism``). The device's half is ``edge_client.loop.dp``."""
