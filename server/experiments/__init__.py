"""What only experiments use: data sets partitioned into simulated clients' shards, simulated fleets (client processes
behind a broker, or clients in-process on a local bus), dishonest clients, and bench suites with their tables.

The server's runtime (orchestrator, strategies, admission, checkpoints, broker, data sets, reports) never imports this
package (tests/test_rooms.py checks it): ``edge-server run`` serves real devices without it.
"""
