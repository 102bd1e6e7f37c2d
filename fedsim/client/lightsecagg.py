"""LightSecAgg's client side: a mod on the train handler answering the four exchanges of
fedsim/server/lightsecagg.py, with the protocol core's own functions (fedsim/secagg/lightsecagg.py).

State between exchanges lives in the node's `Context.state` (a ConfigRecord for keys and parameters,
an ArrayRecord for the mask and the shares received), as Flower's secaggplus_mod keeps its own.
The mask comes from numpy's PCG64 seeded with 32 bytes of os.urandom: unpredictable to the server
for this simulation's purposes, not a vetted cryptographic generator. Shares travel encrypted under
the ECDH key of sender and receiver (Flower's SecAgg+ primitives), each tagged with both indices,
which the receiver checks.
"""

from __future__ import annotations

import os
import struct
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedsim.flower.compat import legacy_fit_ins, legacy_fit_res_update, pairwise_crypto
from fedsim.secagg.field import quantise
from fedsim.secagg.lightsecagg import LightSecAggParams, aggregate_encoded_masks, encode_mask, mask_update
from fedsim.secagg.config import LIGHTSECAGG_RECORD as RECORD, LIGHTSECAGG_STAGES as STAGES
from fedsim.wire import MEASUREMENT_RECORDS

STATE = "lightsecagg-state"
ARRAYS = "lightsecagg-arrays"
TIMING = "secagg-timing"


def _params(st) -> LightSecAggParams:
    n, t, u = int(st["N"]), int(st["T"]), int(st["U"])
    return LightSecAggParams(n, t, n - u, prime=int(st["p"]))


def _tag(src: int, dst: int, share: np.ndarray) -> bytes:
    return struct.pack("<ii", src, dst) + np.ascontiguousarray(share, dtype="<u4").tobytes()


def lightsecagg_mod(msg: Message, context, call_next) -> Message:
    """Answer a LightSecAgg exchange (others pass through); times its own work outside the training."""
    if RECORD not in msg.content.config_records:
        return call_next(msg, context)
    started, trained = time.perf_counter(), 0.0
    cfg = msg.content.config_records[RECORD]
    stage = str(cfg["stage"])
    crypto = pairwise_crypto()
    out = RecordDict()
    if stage == "keys":
        sk, pk = crypto.key_pair()
        state = {k: cfg[k] for k in ("N", "T", "U", "p", "length", "scale", "max-weight", "index")}
        context.state.config_records[STATE] = ConfigRecord({**state, "sk": sk, "pk": pk, "stage": stage})
        out[RECORD] = ConfigRecord({"public-key": pk})
    else:
        st = context.state.config_records[STATE]
        expected = STAGES[STAGES.index(str(st["stage"])) + 1] if str(st["stage"]) in STAGES[:-1] else None
        if stage != expected:
            raise ValueError(f"LightSecAgg: expected stage {expected}, got {stage}")
        params, me = _params(st), int(st["index"])
        if stage == "shares":
            pks = [bytes(b) for b in cfg["public-keys"]]
            if pks[me] != bytes(st["pk"]):
                raise ValueError("LightSecAgg: my public key was relayed wrongly")
            rng = np.random.default_rng(int.from_bytes(os.urandom(32), "little"))
            mask = rng.integers(0, params.prime, int(st["length"]), dtype=np.int64)
            shares = encode_mask(mask, params, rng)  # [N, m]: row j is user j's share
            received = np.zeros_like(shares)
            received[me] = shares[me]
            dsts, ciphers = [], []
            for j, pk in enumerate(pks):
                if j != me and pk:
                    key = crypto.shared_key(bytes(st["sk"]), pk)
                    dsts.append(j)
                    ciphers.append(crypto.encrypt(key, _tag(me, j, shares[j])))
            context.state.array_records[ARRAYS] = ArrayRecord({"mask": Array(mask), "received": Array(received)})
            st["pks"] = pks
            out[RECORD] = ConfigRecord({"destinations": dsts, "ciphertexts": ciphers})
        elif stage == "upload":
            arrays = context.state.array_records[ARRAYS]
            mask, received = arrays["mask"].numpy(), arrays["received"].numpy().copy()
            pks = [bytes(b) for b in st["pks"]]
            for src, cipher in zip(cfg["sources"], cfg["ciphertexts"], strict=True):
                plain = crypto.decrypt(crypto.shared_key(bytes(st["sk"]), pks[int(src)]), bytes(cipher))
                s, d = struct.unpack("<ii", plain[:8])
                if s != int(src) or d != me:
                    raise ValueError(f"LightSecAgg: a share from {s} to {d} reached {me} as from {src}")
                received[s] = np.frombuffer(plain[8:], dtype="<u4").astype(np.int64)
            t0 = time.perf_counter()
            reply = call_next(msg, context)  # the train handler: fitres.* with the flat update
            trained = time.perf_counter() - t0
            (update,), num_examples, metrics = legacy_fit_res_update(reply.content)
            _, fit_config = legacy_fit_ins(msg.content)
            rng = np.random.default_rng(int(fit_config.get("secagg-rounding-seed", 0)))
            weighted = np.asarray(update, dtype=np.float64) * (num_examples / float(st["max-weight"]))
            q = quantise(weighted, float(st["scale"]), params.prime, rng=rng, summands=params.num_users)
            q = np.concatenate([q, np.array([num_examples], dtype=np.int64)])
            masked = mask_update(q, mask, params.prime)
            context.state.array_records[ARRAYS] = ArrayRecord({"received": Array(received)})
            out["lightsecagg-masked"] = ArrayRecord({"masked": Array(masked.astype(np.uint32))})
            out["lightsecagg-metrics"] = MetricRecord({**{k: v for k, v in metrics.items()
                                                          if isinstance(v, (int, float))}, "num_examples": num_examples})
            for name in MEASUREMENT_RECORDS:  # an attacker's reports to the experimenter, as in the clear
                if name in reply.content:
                    out[name] = reply.content[name]
        else:  # aggregate
            received = context.state.array_records[ARRAYS]["received"].numpy()
            share = aggregate_encoded_masks(received, [int(i) for i in cfg["uploaders"]], params.prime)
            out["lightsecagg-share"] = ArrayRecord({"share": Array(share.astype(np.uint32))})
            del context.state.array_records[ARRAYS]
        st["stage"] = stage
        context.state.config_records[STATE] = st
    out.metric_records[TIMING] = MetricRecord({"seconds": time.perf_counter() - started - trained,
                                               "stage": STAGES.index(stage)})
    return Message(out, reply_to=msg)
