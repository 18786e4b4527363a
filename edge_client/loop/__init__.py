"""The device loop: what a device does from registration to its last update. ``runtime`` (``EdgeClient``:
register, wait for assignments, train, report; the Python API), ``session`` (which run is current, what waits for
the server's answer), ``models_cache`` (the round models the device holds), ``trainer`` (the local optimisation
loop that runs an algorithm's hooks; the server's own training and the device benchmark run it too), ``dp`` (the
device's half of differential privacy, before any codec), ``compression`` (the upload coded as the round and the
contract allow) and ``device`` (identity facts and metrics of the machine).

It may import the wire, learning, the algorithms and secagg; none of those imports the loop. The tools and the
command (``edge_client.cli``) build on it.
"""
