"""Buffered asynchronous aggregation (FedBuff, ``train.mode = "buffered"``): the staleness weighting, the event clock of
in-process runs and the loop that keeps every device training while the server aggregates every K updates."""
