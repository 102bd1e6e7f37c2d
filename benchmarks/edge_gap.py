"""The edge-model gap (issue #37 item 4, docs/edge_model.md): run each scenario (default: the MNIST and
Fashion-MNIST ones under scenarios/edge/) in this process, on fedsim's in-process grid (the real
strategy and ClientApp, no Ray), then print

1. per edge copy (evaluation.edge_model), main accuracy and backdoor success on the last round's
   global model, beside the fp32 model's, and the gap edge - fp32 (summary.json's `edge_model`);
2. DIVA vs PGD (fedsim/evasion/diva.py) on the final global model and each int8 (dynamic) / pruned copy: on a
   fixed seeded subset of the test set, L∞ budget `--eps` in pixel units (of [0, 1]), `--steps`
   signed steps of eps/8 (the official code's 8/255 budget with steps of 1/255), c = 1.

    FEDSIM_DATA_DIR=../shared/data python benchmarks/edge_gap.py [SCENARIO ...] [--set key=value ...]

The run folders go under --out (default results/edge_gap); the numbers also go to <out>/edge_gap.json.
An existing run folder given with --run-dir is measured as it is (its last checkpoint), not rerun.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT = [REPO / "scenarios" / "edge" / "mnist_edge_model.yaml", REPO / "scenarios" / "edge" / "fashion_mnist_edge_model.yaml"]


def run(scenario_file: Path, overrides: list[str], out: Path) -> Path:
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server

    scenario = load_scenario(scenario_file, overrides)
    if (out / scenario.name / "summary.json").exists():
        print(f"{scenario.name}: already run in {out / scenario.name}; measuring it (delete the folder to rerun)", flush=True)
        return out / scenario.name
    folder = RunFolder.at(out / scenario.name, scenario, replace_scenario=True)
    started = time.perf_counter()
    grid = LocalGrid(make_client_app(scenario), scenario.federation.num_clients)
    run_server(grid, scenario, folder.path, checkpoints=True)
    print(f"{scenario.name}: {scenario.federation.rounds} rounds in {time.perf_counter() - started:.0f} s -> {folder.path}",
          flush=True)
    return folder.path


def final_model(run_dir: Path):
    """The run's scenario, runtime and last checkpointed global model (low-rank runs included)."""
    from fedsim.runs.checkpoint import load_server
    from fedsim.runtime import Runtime
    from fedsim.scenario import load_scenario
    from fedsim.server.driver import SwitchingModel

    scenario = load_scenario(run_dir / "scenario.yaml", [])
    state = load_server(run_dir, at_most=scenario.federation.rounds)
    if state is None:
        raise SystemExit(f"{run_dir}: no server checkpoint (output.checkpoints must be on)")
    runtime = Runtime(scenario)
    model = SwitchingModel(runtime)
    model.load_state_dict(state.get("extra", {}))
    return scenario, runtime, model.lowrank.model(state["global"]).eval(), int(state["round"])


def measure(run_dir: Path, eps_pixels: float, steps: int, inputs: int, seed: int) -> dict:
    from fedsim.evasion.diva import evasion
    from fedsim.models.edge_copy import edge_copy

    summary = json.loads((run_dir / "summary.json").read_text())
    scenario, runtime, model, rnd = final_model(run_dir)
    x, y = runtime.data.x_test, np.asarray(runtime.data.y_test)
    pick = np.sort(np.random.default_rng(seed).choice(len(y), min(inputs, len(y)), replace=False))
    xs, ys = torch.from_numpy(np.array(x[pick])), torch.from_numpy(y[pick]).long()
    dims = [0] + list(range(2, xs.ndim))
    lo = torch.from_numpy(np.array(x)).amin(dims, keepdim=True)  # pixel 0 and 1 after normalisation
    hi = torch.from_numpy(np.array(x)).amax(dims, keepdim=True)
    scale = (hi - lo).amax().item()  # model units per pixel unit (1 / std)
    out = {"run_dir": str(run_dir), "round": rnd, "fp32": {k: summary.get(k) for k in
                                                            ("final_main_accuracy", "final_backdoor_success")},
           "edge_model": summary.get("edge_model", {}), "detection": summary.get("detection"),
           "defenses": [d["name"] for d in summary["scenario"].get("defenses", [])]
           + [a for a in [summary["scenario"]["aggregator"]["name"]] if a != "fedavg"], "evasion": {},
           "evasion_settings": {"eps_pixels": eps_pixels, "step_pixels": eps_pixels / 8, "steps": steps, "c": 1.0,
                                "inputs": len(ys), "seed": seed, "quantized_engine": torch.backends.quantized.engine}}
    for i, spec in enumerate(scenario.evaluation.edge_model):
        if spec.quantize in ("fp16", "int8_static"):
            # fp16 agrees with fp32 on nearly every input: nothing for DIVA to separate; a static int8
            # copy has no differentiable simulation here
            continue
        started = time.perf_counter()
        edge = edge_copy(model, spec, f"evaluation.edge_model[{i}]")
        got = evasion(model, edge, xs, ys, eps=eps_pixels * scale, step=eps_pixels * scale / 8, steps=steps,
                      lo=lo, hi=hi)
        got["seconds"] = round(time.perf_counter() - started, 1)
        out["evasion"][spec.key()] = got
    return out


def _pct(v) -> str:
    return "   -  " if v is None else f"{100 * v:6.2f}"


def _gap(v) -> str:
    return "   -  " if v is None else f"{100 * v:+6.2f}"


def report(name: str, m: dict) -> None:
    fp32 = m["fp32"]
    print(f"\n== {name} (round {m['round']}; {m['run_dir']})")
    print(f"{'model':<12} {'main acc %':>10} {'gap':>7} {'backdoor %':>10} {'gap':>7} {'agree %':>8}")
    print(f"{'fp32':<12} {_pct(fp32['final_main_accuracy']):>10} {'':>7} {_pct(fp32['final_backdoor_success']):>10}")
    for key, e in m["edge_model"].items():
        print(f"{key:<12} {_pct(e['final_main_accuracy']):>10} {_gap(e['gap']['final_main_accuracy']):>7} "
              f"{_pct(e['final_backdoor_success']):>10} {_gap(e['gap']['final_backdoor_success']):>7} "
              f"{_pct(e['final_agreement']):>8}")
    det = m["detection"] or {}
    if m["defenses"] and det:  # what the defenses and robust rule, which see only the fp32 updates, did to the attackers
        print(f"defenses {', '.join(m['defenses'])} on the fp32 updates: attackers flagged {det['tp']} of "
              f"{det['tp'] + det['fn']}, honest flagged {det['fp']} of {det['fp'] + det['tn']}, attackers clipped "
              f"{det.get('clipped_attackers', 0)}, honest clipped {det.get('clipped_honest', 0)}, attackers' mean weight "
              f"share {_pct(det.get('mean_attacker_weight_share'))} %")
    s = m["evasion_settings"]
    print(f"DIVA vs PGD: {s['inputs']} test inputs (seed {s['seed']}), L-inf {s['eps_pixels']:g} of the pixel range, "
          f"{s['steps']} steps of {s['step_pixels']:g}, c = {s['c']:g}; quantized engine {s['quantized_engine']}")
    print(f"{'copy':<12} {'method':<6} {'qualified':>9} {'edge fooled %':>13} {'undetected %':>12} "
          f"{'undetected/fooled %':>19} {'orig fooled %':>13}")
    for key, e in m["evasion"].items():
        for method in ("diva", "pgd"):
            r = e[method]
            print(f"{key:<12} {method:<6} {e['qualified']:>9} {_pct(r['edge_success']):>13} {_pct(r['undetected']):>12} "
                  f"{_pct(r['undetected_of_success']):>19} {_pct(r['original_fooled']):>13}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="*", type=Path, help="scenario files (default: scenarios/edge/*_edge_model.yaml)")
    p.add_argument("--run-dir", action="append", type=Path, default=[], help="measure this finished run folder instead")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="key.path=value, as `fedsim run --set`")
    p.add_argument("--out", type=Path, default=REPO / "results" / "edge_gap")
    p.add_argument("--eps", type=float, default=0.1, help="L-inf budget in pixel units of [0, 1] (default 0.1)")
    p.add_argument("--steps", type=int, default=20, help="attack steps of eps/8 (default 20, as the official code)")
    p.add_argument("--inputs", type=int, default=1000, help="test inputs attacked (a fixed seeded subset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dirs = list(args.run_dir) or [run(f, args.overrides, args.out) for f in (args.scenarios or DEFAULT)]
    results = {}
    for run_dir in run_dirs:
        m = measure(run_dir, args.eps, args.steps, args.inputs, args.seed)
        name = json.loads((run_dir / "summary.json").read_text())["name"]
        results[name] = m
        report(name, m)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edge_gap.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
