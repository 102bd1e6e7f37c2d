"""FedMA with communication (Wang et al., ICLR 2020): the `fedma` round protocol's server side
(fedsim/server/exchange.py: the calling convention), K+1 message exchanges per round for a
network with K matched layers. The global model is a `MatchedModel` (its widths grow), which
replaces the driver's flat switching model.

Round t, with the sampled clients J:
1. "local": every client trains its model (round 1: its own initialisation; later: the global
   model sliced to its own neurons with its assignments from round t-1; a client that missed
   round t-1 gets the whole global model) and uploads layer 0.
2. For l = 0..K-1: BBP-MAP matches layer l over the uploads (scipy's Hungarian inside); the
   matched layer and each client's assignment go back; the client freezes layers <= l, retrains
   the rest and uploads layer l+1.
3. The output layer (uploaded in the last exchange, already in the global order of layer K-1) is
   averaged per class, weighted by each client's share of that class's samples.

The global model's hidden widths may grow; its shape travels in the messages. A client whose
reply is missing or malformed in any exchange is dropped for the rest of the round (logged with
the reason in rounds.jsonl), and the round carries on with the others.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedsim.fedma.matching import average_last_layer, bbp_map_match
from fedsim.fedma.arch import State, num_params
from fedsim.fedma.client import arch_for, record_to_state, state_to_record
from fedsim.models.layout import ModelLayout
from fedsim.seeding import SERVER, derive_seed
from fedsim.server.record import RoundRecord
from fedsim.server.exchange import ReplyOwners
from fedsim.compression.base import PayloadError
from fedsim.wire import MAX_EXAMPLES, check_loss, error_text, excerpt, message_bytes, records_bytes

log = logging.getLogger("fedsim")

ROW_CAP_FACTOR = 4  # an upload may hold at most this many times max(max_neurons, default width) neurons


class UploadError(ValueError):
    """A FedMA reply that is missing, malformed or of the wrong shape."""


class MatchedModel:
    """FedMA's global model: a flat vector at the current hidden widths, and each client's neuron
    assignments from the last round it completed (checkpointed with it)."""

    def __init__(self, runtime, arch, vec: torch.Tensor) -> None:
        from fedsim.fedma.arch import resized_default, state_of

        spec = runtime.scenario.model
        self.arch = arch
        self.widths = arch.widths(state_of(resized_default(spec.name, runtime.data.input_shape,
                                                           runtime.data.num_classes, spec)))
        self._layouts: dict[tuple[int, ...], ModelLayout] = {}
        self.vec = vec
        self.assignments: dict[int, list[np.ndarray]] = {}

    def layout(self) -> ModelLayout:
        if self.widths not in self._layouts:
            self._layouts[self.widths] = ModelLayout.of(self.arch.build(self.widths))
        return self._layouts[self.widths]

    def state(self) -> State:
        return {k: v.numpy().copy() for k, v in self.layout().unflatten(self.vec).items()}

    def set_state(self, state: State) -> None:
        self.widths = self.arch.widths(state)
        self.vec = self.layout().flatten({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})

    def module(self) -> torch.nn.Module:
        return self.arch.model(self.state())

    def after_round(self, rnd: int) -> None:
        return None  # the widths grew, if at all, when the layers were matched

    def config(self) -> dict:
        return {}  # the shape travels in FedMA's own messages

    def state_dict(self) -> dict:
        return {"fedma": {"widths": list(self.widths),
                          "assignments": {str(p): [a.tolist() for a in lst] for p, lst in self.assignments.items()}}}

    def load_state_dict(self, extra: dict) -> None:
        saved = extra["fedma"]
        self.widths = tuple(int(w) for w in saved["widths"])
        self.assignments = {int(p): [np.asarray(a, dtype=np.int64) for a in lst] for p, lst in saved["assignments"].items()}


class FedMAExchange:
    """FedMA's K + 1 exchanges a round (see the module's docstring)."""

    def __init__(self, driver, node_of: dict[int, int]) -> None:
        self.driver, self.node_of = driver, node_of
        self.scenario, self.rt = driver.scenario, driver.rt
        self.arch = arch_for(driver.rt)
        self.params = self.scenario.aggregator
        self.model = driver.model = MatchedModel(driver.rt, self.arch, driver.global_vec)
        self.template = {k: tuple(v.shape) for k, v in self.arch.build(self.model.widths).state_dict().items()}
        self.initial_params = num_params(self.model.state())
        self.grid: Grid | None = None
        self._exchange: list[tuple[Message, int]] = []  # the current exchange's messages and their clients

    # --- exchange 0: local training ----------------------------------------------------------------
    def configure(self, plan, grid: Grid) -> list[Message]:
        rnd, sampled = plan.round, plan.sampled
        self.grid = grid
        fresh = rnd == 1 and self.params.local_init
        gstate = None if fresh else self.model.state()
        messages, down_per_client = [], {}
        self._exchange = []  # (message, partition id) of this exchange: replies are matched to them
        for pid in sampled:
            content = {"config": ConfigRecord({"server-round": rnd, "fedma-step": "local"})}
            if gstate is not None:
                own = self.model.assignments.get(pid)
                content["arrays"] = state_to_record(self.arch.slice_for_client(gstate, own) if own else gstate)
            down_per_client[pid] = records_bytes(content)
            messages.append(Message(RecordDict(content), dst_node_id=self.node_of[pid], message_type=MessageType.TRAIN))
            self._exchange.append((messages[-1], pid))
        self.driver.pending.bytes_down = sum(down_per_client.values())
        self.driver.pending.bytes_down_per_client = down_per_client
        return messages

    # --- exchanges 1..K: match, broadcast, retrain above --------------------------------------------
    def aggregate(self, replies: list[Message]) -> int | None:
        record = self.driver.pending
        rnd = record.round
        record.update({"bytes_up": 0, "bytes_up_per_client": {}, "rejected": {}, "defenses": {}, "skipped": None})
        new_state = self.model.state()  # filled layer by layer; shapes change as layers are matched
        counts, losses = {}, {}
        current = self._collect(list(replies), 0, record.sampled, new_state, record, counts, losses)
        record.train_loss = float(np.mean([losses[p] for p in sorted(losses)])) if losses else None
        own: dict[int, list[np.ndarray]] = {pid: [] for pid in current}
        match_seconds, exchanges = 0.0, 1
        for l in range(self.arch.num_matched):
            if not self._enough(current, record, rnd, f"matching layer {l}"):
                return None
            pids = sorted(current)
            t0 = time.perf_counter()
            result = bbp_map_match(
                [self.arch.neurons({**new_state, **current[p]}, l) for p in pids],
                **self.params.match_kwargs(),
                seed=derive_seed(self.scenario.seed, SERVER, rnd, l),
            )
            match_seconds += time.perf_counter() - t0
            self.arch.set_neurons(new_state, l, result.theta)
            layer = self.arch.layers[l]
            messages = []
            self._exchange = []
            for pid, assignment in zip(pids, result.assignments):
                own[pid].append(assignment)
                content = {
                    "arrays": state_to_record({
                        "weight": new_state[layer.weight], "bias": new_state[layer.bias], "assignment": assignment,
                    }),
                    "config": ConfigRecord({"server-round": rnd, "fedma-step": "retrain", "fedma-layer": l + 1}),
                }
                size = records_bytes(content)
                record.bytes_down += size
                record.bytes_down_per_client[pid] = record.bytes_down_per_client.get(pid, 0) + size
                messages.append(Message(RecordDict(content), dst_node_id=self.node_of[pid], message_type=MessageType.TRAIN))
                self._exchange.append((messages[-1], pid))
            replies = list(self.grid.send_and_receive(messages, timeout=self.scenario.federation.round_timeout))
            exchanges += 1
            self._widen_inputs(new_state, l)
            current = self._collect(replies, l + 1, pids, new_state, record, counts, losses)
        if not self._enough(current, record, rnd, "averaging the output layer"):
            return None
        pids = sorted(current)
        out = self.arch.layers[-1]
        weight, bias = average_last_layer(
            [current[p][out.weight] for p in pids], [current[p][out.bias] for p in pids], [counts[p] for p in pids]
        )
        new_state[out.weight], new_state[out.bias] = weight.astype(np.float32), bias.astype(np.float32)
        self.model.set_state(new_state)
        self.model.assignments = {p: own[p] for p in pids}
        params_now = num_params(new_state)
        record.update({
            "aggregated": pids,
            "exchanges": exchanges,
            "global_widths": list(self.model.widths),
            "model_params": params_now,
            "model_growth": params_now / self.initial_params,
            "match_seconds": match_seconds,
            "global_norm": float(torch.linalg.vector_norm(self.model.vec)),
        })
        return len(pids)

    def _enough(self, current: dict, record: RoundRecord, rnd: int, what: str) -> bool:
        need = self.scenario.federation.min_replies
        if len(current) >= need:
            return True
        record.skipped = f"{len(current)} valid replies before {what}, fewer than federation.min_replies={need}"
        log.warning("round %s skipped: %s", rnd, record.skipped)
        return False

    def _widen_inputs(self, state: State, l: int) -> None:
        """Give layer l+1 of the global state its new input width (values come from the clients)."""
        above = self.arch.layers[l + 1].weight
        state[above] = np.zeros(self._expected_weight_shape(state, l + 1, state[above].shape[0]), dtype=np.float32)

    def _expected_weight_shape(self, state: State, l: int, rows: int) -> tuple[int, ...]:
        """Layer l's weight shape for `rows` neurons, given the (global) width of layer l-1 in `state`."""
        template = self.template[self.arch.layers[l].weight]
        if l == 0:
            return (rows, *template[1:])
        kind, spatial = self.arch.links[l - 1]
        units = state[self.arch.layers[l - 1].weight].shape[0]
        if kind == "conv":
            return (rows, units, *template[2:])
        return (rows, units * spatial)

    def _collect(self, replies, l: int, expected: list[int], state: State, record: RoundRecord, counts: dict, losses: dict) -> dict:
        """Valid uploads of layer l by partition id; the rest are logged in `rejected`."""
        owner = ReplyOwners(self._exchange)
        out, seen = {}, set()
        for reply in replies:
            pid = owner(reply)
            seen.add(pid)
            if pid not in expected:
                continue
            if reply.has_error():
                record.rejected[pid] = f"layer {l}: client error: {reply.error.reason}"
                continue
            try:
                size = message_bytes(reply)
                record.bytes_up += size
                record.bytes_up_per_client[pid] = record.bytes_up_per_client.get(pid, 0) + size
                out[pid] = self._check_upload(reply.content, l, state, counts, pid)
                if l == 0:
                    losses[pid] = check_loss(reply.content["metrics"].get("train-loss"))
            except Exception as err:  # an untrusted reply: whatever is wrong with it rejects it, never the round
                out.pop(pid, None)
                losses.pop(pid, None)
                reason = str(err) if isinstance(err, (UploadError, PayloadError)) else f"malformed reply: {error_text(err)}"
                record.rejected[pid] = f"layer {l}: {reason}"
                log.warning("round %s: rejected FedMA upload from client %s: %s", record.round, pid, err)
        for pid in expected:
            if pid not in seen:
                record.rejected[pid] = f"layer {l}: no reply within federation.round_timeout={self.scenario.federation.round_timeout}s"
        return out

    def _check_upload(self, content, l: int, state: State, counts: dict, pid: int) -> State:
        """Layer l's (weight, bias) from an untrusted reply, with shapes and values checked."""
        layer = self.arch.layers[l]
        try:
            arrays = record_to_state(content["layer"])
        except Exception as err:  # missing record, non-numpy bytes
            raise UploadError(f"reply needs a 'layer' ArrayRecord of arrays ({error_text(err)})") from None
        weight, bias = arrays.get("weight"), arrays.get("bias")
        if weight is None or bias is None:
            raise UploadError(f"missing weight or bias, got {excerpt(sorted(arrays))}")
        last = l == self.arch.num_matched
        rows = weight.shape[0] if weight.ndim else 0
        cap = ROW_CAP_FACTOR * max(self.params.max_neurons, self.template[layer.weight][0])
        if last and rows != self.rt.data.num_classes or not 1 <= rows <= cap:
            raise UploadError(f"{rows} neurons in layer {l} (allowed: {'the number of classes' if last else f'1..{cap}'})")
        want = self._expected_weight_shape(state, l, rows)
        if weight.shape != want or bias.shape != (rows,):
            raise UploadError(f"weight {weight.shape} / bias {bias.shape}, expected {want} / {(rows,)}")
        if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
            raise UploadError("weights contain NaN or Inf")
        with np.errstate(over="ignore"):  # an overflowing norm is the rejection below, not a warning
            norms_finite = np.isfinite(np.linalg.norm(weight)) and np.isfinite(np.linalg.norm(bias))
        if not norms_finite:
            raise UploadError("weight or bias norm overflows float32 (entries finite, L2 norm is not)")
        if l == 0:
            c = arrays.get("class-counts")
            if (c is None or c.shape != (self.rt.data.num_classes,) or not np.isfinite(c).all() or (c < 0).any()
                    or (c > MAX_EXAMPLES).any()):
                raise UploadError(f"class-counts must be one count in [0, {MAX_EXAMPLES}] per class ({self.rt.data.num_classes}), "
                                  f"got {excerpt(None if c is None else c.reshape(-1)[:8].tolist())}")
            counts[pid] = c.astype(np.float64)
        return {layer.weight: weight, layer.bias: bias}
