"""Flower's SecAgg+ and fedsim's LightSecAgg, measured on the same real fedsim rounds.

Run: `FEDSIM_DATA_DIR=../shared/data OMP_NUM_THREADS=1 .venv/bin/python benchmarks/secagg_rounds.py
[--users 5 10 20] [--rates 0 0.1 0.3] [--hidden 256]`.

One round of the digits quickstart (MLP with one hidden layer of `--hidden` units, so
d = 64·h + h + 10·h + 10; IID partitions; every client sampled) on the in-process grid, once under
each protocol:
- SecAgg+: Flower's SecAggPlusWorkflow and secaggplus_mod, num_shares = 1.0 (every client shares
  with every other, as in SecAgg), reconstruction_threshold = 0.5;
- LightSecAgg: fedsim/server/lightsecagg.py and fedsim/client/lightsecagg.py, T = floor(N/2),
  D = ceil(0.3·N), U = N − D.
round(rate·N) clients drop after the key and share exchanges and before sending their masked
update (SecAgg+: its recovery then costs the server a pairwise-mask expansion per dropped client
and surviving neighbour; LightSecAgg: nothing more than without dropouts). Bytes per client are
the serialized messages of all four exchanges (mean over the clients that finished); client
seconds are the protocol's own work outside the local training; server seconds are the server's
own protocol work, outside its waits on the grid.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from fedsim.client.app import make_client_app  # noqa: E402
from fedsim.flower.local_grid import StageDropGrid  # noqa: E402
from fedsim.runs.folder import RunFolder  # noqa: E402
from fedsim.runs.results import read_rounds  # noqa: E402
from fedsim.runtime import runtime_for  # noqa: E402
from fedsim.scenario import load_scenario  # noqa: E402
from fedsim.server.app import run_server  # noqa: E402


PROTOCOLS = {  # the section and the stage a dropped client leaves at: after keys/shares, before its masked upload
    "secaggplus": ("{name: secaggplus, num_shares: 1.0, reconstruction_threshold: 0.5}", "collect_masked_vectors"),
    "lightsecagg": ("{name: lightsecagg, privacy: 0.5, dropout: 0.3}", "upload"),
}


def secure_round(protocol: str, n: int, rate: float, hidden: int) -> dict:
    section, stage = PROTOCOLS[protocol]
    sc = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), [
        f"federation.num_clients={n}", f"federation.clients_per_round={n}", "federation.rounds=1",
        "federation.local_epochs=1", "attack=null", "evaluation.overlap=false", "evaluation.initial=false",
        f"model={{name: mlp, hidden: [{hidden}]}}", "data.partition={name: iid}", f"secure_aggregation={section}"])
    dropped = list(range(1, n))[: round(rate * n)]  # every client is sampled: drop ids 1..k
    folder = RunFolder.create(sc, tempfile.mkdtemp())
    run_server(StageDropGrid(make_client_app(sc), n, {p: stage for p in dropped}), sc, folder)
    line = [r for r in read_rounds(folder) if r["round"] == 1][0]
    summed = line["secure_aggregation"]["summed"]
    assert line["skipped"] is None and len(summed) == n - len(dropped), line.get("skipped")
    up = [line["bytes_up_per_client"][str(p)] for p in summed]
    down = [line["bytes_down_per_client"][str(p)] for p in summed]
    seconds = line["secure_aggregation_seconds"]
    client = [seconds["clients"][str(p)] for p in summed]
    return {"d": runtime_for(sc).layout.dim, "dropped": len(dropped), "up": sum(up) / len(up),
            "down": sum(down) / len(down), "client": sum(client) / len(client), "server": seconds["server"],
            "group": line["secure_aggregation"]["groups"][0]}


def main() -> None:
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's per-round INFO lines would bury the table
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    header = (f"{'N':>3} {'drop':>4} {'d':>6} {'T':>3} {'U':>3} {'SA+ up MB':>9} {'SA+ down MB':>11} {'SA+ client s':>12} "
              f"{'SA+ server s':>12} {'LSA up MB':>9} {'LSA down MB':>11} {'LSA client s':>12} {'LSA server s':>12}")
    print("per client: mean over the clients that finished; both protocols measured on the same fedsim round")
    print(header)
    print("-" * len(header))
    for n in args.users:
        for rate in args.rates:
            sa = secure_round("secaggplus", n, rate, args.hidden)
            lsa = secure_round("lightsecagg", n, rate, args.hidden)
            g = lsa["group"]
            print(f"{n:>3} {sa['dropped']:>4} {sa['d']:>6} {g['privacy']:>3} {g['target']:>3} {sa['up'] / 1e6:>9.3f} "
                  f"{sa['down'] / 1e6:>11.3f} {sa['client']:>12.4f} {sa['server']:>12.4f} {lsa['up'] / 1e6:>9.3f} "
                  f"{lsa['down'] / 1e6:>11.3f} {lsa['client']:>12.4f} {lsa['server']:>12.4f}", flush=True)


if __name__ == "__main__":
    main()
