"""What is learned, from what and for what, built the same way by the server and by every device: the models
and their flat parameter vectors (``models``, ``flat``), a user's model or task factory (``factories``), the task's
loss and metrics (``tasks``), a device's own data (``data``) and the exported model's inference (``predictor``).

It imports no other room of ``edge_client``: a model, a task and a data set know nothing of the wire, the
algorithms or the device loop (the server evaluates with the same code, and ``predictor`` runs without torch).
"""
