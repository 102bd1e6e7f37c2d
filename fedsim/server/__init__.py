"""The server: a thin Flower strategy (strategy.py) over a Flower-free round driver (driver.py:
sampling, schedules, groups, the global model and its server step, checkpoints, resume), the
pipeline of attack, defenses and rule (pipeline.py), the round's close (closing.py: evaluation,
the round's line, timing) and the round protocols' exchanges (exchange.py, secure.py).

Importing this package registers the default round protocol, `plain`, and nothing heavier; the
other protocols register beside their own code (fedsim/secagg/config.py, fedsim/fedma/matching.py)."""

from fedsim.registry import PROTOCOLS, Params


class PlainParams(Params):
    """The default round: one exchange, every sampled client trains and uploads its (encoded) update."""


PROTOCOLS.register("plain", PlainParams, exchange="fedsim.server.exchange:PlainExchange",
                   client_step="fedsim.client.steps:plain_train", cohort_training=True)(PlainParams)
