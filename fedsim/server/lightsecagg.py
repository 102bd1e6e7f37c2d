"""LightSecAgg's server side as four exchanges on a Flower grid (the protocol core: fedsim/secagg/lightsecagg.py).

    keys       server -> each client: N, T, U, p, its index, the vector length   client -> its public key
    shares     server -> each client: every public key      client -> N-1 encrypted encoded mask shares
    upload     server -> each client: the shares addressed to it + its training instruction (fitins.*)
               client -> x̃_i = φ(c·w_i/W·x_i) ‖ w_i + z_i  (mod p), its metrics in the clear
    aggregate  server -> each uploader: the set U1 of uploaders   client -> Σ_{i∈U1} [z̃_i]_j

The server relays the shares but cannot read them: each is Fernet-encrypted under the ECDH key of
its sender and receiver (Flower's SecAgg+ primitives, fedsim/flower/compat.py:
pairwise_crypto). From any U aggregated shares it decodes Σ_{i∈U1} z_i in one step and returns
Σ_{i∈U1} x̃_i − Σ z_i = Σ_{i∈U1} (quantised weighted update ‖ weight); the weights sum exactly, so
the weighted mean is off from FedAvg's only by the rounding, < n·W/(c·Σ w_i) per coordinate.

A client that drops before its upload is left out (its mask is never summed); one that drops after
it stays in the sum (the others' shares of its mask are in their aggregated shares). Fewer than U
uploads or aggregated shares halt the round, as the paper's server must.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict, Array

from fedsim.secagg.config import LIGHTSECAGG_RECORD, LIGHTSECAGG_STAGES
from fedsim.server.exchange import ReplyOwners
from fedsim.secagg.field import dequantise
from fedsim.secagg.lightsecagg import RoundRefused, server_aggregate

RECORD, STAGES = LIGHTSECAGG_RECORD, LIGHTSECAGG_STAGES


@dataclass
class LightSecAggRound:
    aggregate: list | None = None
    summed: list[int] = field(default_factory=list)
    metrics: dict[int, dict] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _send(grid, contents: dict[int, RecordDict], rnd: int, timeout) -> dict[int, Message]:
    """Each node's reply, keyed by the node its message went to: a SuperLink's error reply for an
    offline node comes from the link's own id, so replies are matched to the messages they answer
    (fedsim/server/exchange.py: ReplyOwners), never keyed by `src_node_id`."""
    msgs = [Message(content, dst_node_id=nid, message_type=MessageType.TRAIN, group_id=str(rnd))
            for nid, content in contents.items()]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    owner = ReplyOwners([(m, m.metadata.dst_node_id) for m in msgs])
    return {owner(r): r for r in replies}


def _ok(replies: dict[int, Message], failures: list[str]) -> dict[int, Message]:
    good = {}
    for nid, r in replies.items():
        if r.has_error():
            failures.append(f"node {nid}: {r.error.reason}")
        else:
            good[nid] = r
    return good


def run_lightsecagg(grid, fit_ins: dict[int, tuple[list, dict]], server_round: int, *, section, max_weight: float,
                    length: int, timeout: float | None) -> LightSecAggRound:
    """One LightSecAgg secure sum over the nodes of `fit_ins` (node id -> (model arrays, config)); the
    weighted mean of their `length`-coordinate updates, or `aggregate=None` with the reason in `failures`."""
    out = LightSecAggRound()
    nodes = sorted(fit_ins)
    params = section.params(len(nodes))
    index = {nid: i for i, nid in enumerate(nodes)}
    base = {"N": params.num_users, "T": params.privacy, "U": params.target, "p": params.prime, "length": length + 1,
            "scale": float(section.scale), "max-weight": float(max_weight)}

    def stage(name: str, extra: dict) -> ConfigRecord:
        return ConfigRecord({"stage": name, **extra})

    # keys
    replies = _ok(_send(grid, {n: RecordDict({RECORD: stage("keys", {**base, "index": index[n]})}) for n in nodes},
                        server_round, timeout), out.failures)
    alive = [n for n in nodes if n in replies]
    keys = {n: bytes(replies[n].content[RECORD]["public-key"]) for n in alive}
    if len(alive) < params.target:
        out.failures.append(f"only {len(alive)} clients sent keys, LightSecAgg needs U={params.target}")
        return out
    # shares: every public key (index order; an absent client's is empty)
    pks = [keys.get(n, b"") for n in nodes]
    replies = _ok(_send(grid, {n: RecordDict({RECORD: stage("shares", {"public-keys": pks})}) for n in alive},
                        server_round, timeout), out.failures)
    alive = [n for n in alive if n in replies]
    inbox: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in alive}
    for src in alive:
        rec = replies[src].content[RECORD]
        for dst, cipher in zip(rec["destinations"], rec["ciphertexts"], strict=True):
            dst_node = nodes[int(dst)] if 0 <= int(dst) < len(nodes) else None
            if dst_node in inbox:
                inbox[dst_node][0].append(index[src])
                inbox[dst_node][1].append(bytes(cipher))
    # upload: the training instruction travels with the shares
    contents = {}
    for n in alive:
        arrays, config = fit_ins[n]
        content = RecordDict({
            "fitins.parameters": ArrayRecord({str(i): Array(a) for i, a in enumerate(arrays)}),
            "fitins.config": ConfigRecord(dict(config)),
            RECORD: stage("upload", {"sources": inbox[n][0], "ciphertexts": inbox[n][1]}),
        })
        contents[n] = content
    replies = _ok(_send(grid, contents, server_round, timeout), out.failures)
    uploads = {index[n]: replies[n].content["lightsecagg-masked"]["masked"].numpy().astype(np.int64)
               for n in alive if n in replies}
    uploaders = [n for n in alive if n in replies]
    metrics = {n: dict(replies[n].content["lightsecagg-metrics"]) for n in uploaders}
    if len(uploaders) < params.target:
        out.failures.append(f"only {len(uploaders)} masked uploads, LightSecAgg with N={params.num_users}, "
                            f"T={params.privacy}, D={params.dropout} needs U={params.target}")
        return out
    # aggregate
    u1 = sorted(index[n] for n in uploaders)
    replies = _ok(_send(grid, {n: RecordDict({RECORD: stage("aggregate", {"uploaders": u1})}) for n in uploaders},
                        server_round, timeout), out.failures)
    aggregated = {index[n]: replies[n].content["lightsecagg-share"]["share"].numpy().astype(np.int64)
                  for n in uploaders if n in replies}
    try:
        total = server_aggregate(uploads, aggregated, params)
    except RoundRefused as err:
        out.failures.append(str(err))
        return out
    weight_sum = int(total[-1])  # Σ w_i, exact (far below p)
    weighted = dequantise(total[:-1], section.scale, params.prime)  # Σ w_i/W · x_i
    out.aggregate = [weighted / (weight_sum / max_weight)]
    out.summed = sorted(uploaders)
    out.metrics = metrics
    return out
