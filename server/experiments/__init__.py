"""What only experiments use: packaged data sets and their partitions, simulated fleets (client processes behind a
broker, or clients in-process on a local bus), dishonest clients, and bench suites with their tables.

The server's runtime (orchestrator, strategies, admission, checkpoints, broker, reports) never needs this package to
serve real devices, except to load a data set for server-side evaluation when one is configured.
"""
