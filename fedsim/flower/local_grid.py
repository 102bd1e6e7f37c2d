"""An in-process Flower Grid that calls the ClientApp directly: the same messages and the same
strategy code as under Ray, without Ray's start-up cost. The fast tests, the golden metrics and
the benchmarks' plain references run on it; `tamper` and `fail` rewrite or crash chosen replies,
and `offline` nodes are answered for by the link, as a SuperLink answers for a node it has marked
offline (an error reply from the link's own node id). Each batch of messages is first handed to the app as
one cohort (its `prepare_cohort`, fedsim/client/cohort.py), as the simulation's actors get them
(fedsim/engine/cohorts.py); `cohorts=False` hands them over one by one."""

from __future__ import annotations

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid

from uuid import uuid4

from fedsim.flower.compat import act_as_superlink, from_the_link, secaggplus_record_key, stamp_message_id


class LocalGrid(Grid):
    def __init__(self, client_app, num_nodes: int, tamper=None, fail=(), offline=(), cohorts: bool = True) -> None:
        act_as_superlink(run_id=1)  # Messages need a task identity outside a running app
        self._app = client_app
        self._ids = [1000 + 7 * i for i in range(num_nodes)]  # node ids unrelated to partition ids
        self._ctx = {
            n: Context(run_id=1, node_id=n, node_config={"partition-id": i, "num-partitions": num_nodes},
                       state=RecordDict(), run_config={})
            for i, n in enumerate(self._ids)
        }
        self.tamper = tamper  # optional: (partition id, reply) -> reply, to simulate broken uploads
        self.fail = set(fail)  # partition ids whose ClientApp crashes
        self.offline = set(offline)  # partition ids whose node is gone: the link answers for them, from its own id
        # each batch of messages goes to the app as one cohort first, as the simulation's actors get them
        self.prepare_cohort = getattr(client_app, "prepare_cohort", None) if cohorts else None

    def set_run(self, run):
        pass

    @property
    def run(self):
        raise AttributeError("LocalGrid has no run")

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self):
        return list(self._ids)

    def push_messages(self, messages):
        raise AttributeError("LocalGrid only supports send_and_receive")

    def pull_messages(self, message_ids):
        raise AttributeError("LocalGrid only supports send_and_receive")

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            stamp_message_id(m, str(uuid4()))  # as a grid does when it pushes a message
        if self.prepare_cohort is not None:
            self.prepare_cohort(messages, [self._ctx[m.metadata.dst_node_id] for m in messages])
        for m in messages:
            ctx = self._ctx[m.metadata.dst_node_id]
            if int(ctx.node_config["partition-id"]) in self.offline and m.metadata.message_type == "train":
                out.append(from_the_link(Message(Error(code=0, reason="the node is offline"), reply_to=m)))
                continue
            try:
                if int(ctx.node_config["partition-id"]) in self.fail and m.metadata.message_type == "train":
                    raise RuntimeError("device out of memory")
                reply = self._app(m, ctx)
            except Exception as ex:  # a crashing client becomes an error reply, as in Flower
                reply = Message(Error(code=0, reason=repr(ex)), reply_to=m)
            if self.tamper is not None and m.metadata.message_type == "train":
                reply = self.tamper(int(ctx.node_config["partition-id"]), reply)
            out.append(reply)
        return out[::-1]  # reversed arrival order: aggregation must not depend on it


class StageDropGrid(LocalGrid):
    """LocalGrid whose chosen clients drop at a chosen secure-aggregation stage (SecAgg+ or
    LightSecAgg, `drop`: partition id -> stage name): the link answers for them with an error from
    then on, as for a node that went offline mid-protocol (the dropout tests and
    benchmarks/secagg_rounds.py)."""

    def __init__(self, app, n: int, drop: dict[int, str]) -> None:
        super().__init__(app, n)
        self.drop = drop
        self.gone: set[int] = set()

    def send_and_receive(self, messages, *, timeout=None):
        keep, out = [], []
        keys = (secaggplus_record_key(), "lightsecagg")
        for m in messages:
            pid = int(self._ctx[m.metadata.dst_node_id].node_config["partition-id"])
            key = next((k for k in keys if k in m.content.config_records), None)
            stage = m.content.config_records[key].get("stage") if key else None
            if pid in self.drop and (self.drop[pid] == stage or pid in self.gone):
                self.gone.add(pid)
                stamp_message_id(m, f"gone-{pid}-{stage}")
                out.append(Message(Error(code=0, reason="the node is offline"), reply_to=m))
            else:
                keep.append(m)
        return list(super().send_and_receive(keep, timeout=timeout)) + out
