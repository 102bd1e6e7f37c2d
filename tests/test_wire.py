"""What a message weighs on the wire (fedsim/wire.py): records sized apart add up to the whole."""

from __future__ import annotations


def test_model_record_sized_once_adds_up_to_the_whole_message():
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from fedsim.wire import records_bytes

    arrays = ArrayRecord(array_dict={"w": Array(np.random.rand(777).astype(np.float32))})
    config = ConfigRecord({"server-round": 3, "lr": 0.1, "data-partition": 4})
    whole = records_bytes({"arrays": arrays, "config": config})
    assert whole == records_bytes({"arrays": arrays}) + records_bytes({"config": config}) > 4 * 777
