"""What a strategy wants one device to do in one round: its :class:`Plan`.

The server half of an algorithm returns one plan per device (``Strategy.assign``): the local steps, the optimiser,
the contract's device settings and per-round values (FedVeca's ``P``, TACO's ``alpha_i``) and the arrays the device
half reads. The plan travels as it is, inside the ``Assignment`` that also carries the round's facts
(``edge_client.wire.messages.RoundFacts``), and the device trains it as it arrives (``trainer.train_local``): no field
is copied from one record into another on the way. Its header fields are declared with their bounds like every
message's (``edge_client.wire.schema``); ``arrays`` and ``weights`` travel as arrays (this device's own in the
assignment, the ones every device shares and the start model once per round in the ``GlobalModel``). Something new a
strategy tells each device (a privacy setting, say) is one more declared field here, or a value of the algorithm's
contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge_client.wire.schema import MAPPING, integer, number, on_wire


@dataclass
class Plan:
    """One round of local training for one device.

    ``settings`` holds the contract's device settings and per-round values (checked against the contract before
    training: ``Contract.check_plan``); ``arrays`` every vector the device half reads; ``weights`` the model to start
    from when it is not the round's global model (FedACG's look-ahead model; on a device, the model its assignment
    names once the model cache has it).
    """

    steps: int = on_wire(integer(1))
    lr: float = on_wire(number(positive=True))
    batch_size: int = on_wire(integer(1))
    settings: dict[str, Any] = on_wire(MAPPING, factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # not in the header: they travel as arrays
    momentum: float = on_wire(number(0.0), default=0.0)
    weight_decay: float = on_wire(number(0.0), default=0.0)
    weights: np.ndarray | None = None  # not in the header: the round's model travels once, in the GlobalModel
    EVERY_FIELD_REQUIRED: ClassVar[bool] = True  # the defaults serve the code that builds one, not the wire
