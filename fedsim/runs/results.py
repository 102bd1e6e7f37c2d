"""The run folder: the resolved scenario, one JSON line per round (appended as soon as the round
ends, so an interrupted run keeps what it computed) and a summary written at the end."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from fedsim.devices import determinism_report
from fedsim.runs.atomic import write_text_atomic
from fedsim.privacy.local import LocalPrivacyLedger
from fedsim.runs.folder import RunFolder
from fedsim.runs.lifecycle import backdoor_lifecycle
from fedsim.scenario import scenario_dict
from fedsim.runs.detection import run_detection


def _clean(value):
    """JSON has no NaN: write None instead, so every tool can read the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def append_round(run_dir: Path | RunFolder, record: dict) -> None:
    """Append the round's line and flush it to disk. A write that fails (a full disk) raises an
    OSError naming rounds.jsonl; what it left is a torn last line, which a resume drops."""
    path = RunFolder.of(run_dir).rounds_file
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(_clean(record)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        if err.filename is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise


def rewrite_rounds(run_dir: Path | RunFolder, records: list[dict]) -> None:
    """Replace rounds.jsonl by `records` in one step (a resume dropping rounds it redoes, or a torn
    last line): a kill while rewriting leaves the old file, whose lines the next resume reads again."""
    text = "".join(json.dumps(_clean(r)) + "\n" for r in records)
    write_text_atomic(RunFolder.of(run_dir).rounds_file, text)


def read_rounds(run_dir: Path | RunFolder) -> list[dict]:
    """The run's round lines. A last line cut short (the process killed while appending it) is
    left out: that round is redone on resume, which rewrites the file (`rounds_torn`). A line that
    is not a record anywhere else is damage, not a kill: an error naming the file and the line."""
    path = RunFolder.of(run_dir).rounds_file
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1 and rounds_torn(run_dir):
                break
            raise ValueError(f"{path}: line {i + 1} is not a round record ({err})") from None
    return out


def rounds_torn(run_dir: Path | RunFolder) -> bool:
    """Whether rounds.jsonl ends inside a line (every complete line ends with a newline)."""
    path = RunFolder.of(run_dir).rounds_file
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) != b"\n"


def every_round_skipped(rounds: list[dict]) -> str | None:
    """Why the run measured nothing, when no training round of it was aggregated (None otherwise):
    such a run must not end as a success, its numbers are those of the initial model."""
    trained = [r for r in rounds if r["round"] > 0]
    if not trained or any(not r.get("skipped") for r in trained):
        return None
    reasons = sorted({str(r["skipped"]) for r in trained})
    return f"every round was skipped ({len(trained)} of {len(trained)}); the model was never updated: " + "; ".join(reasons[:3])


def _versions() -> dict:
    import flwr
    import torch

    from fedsim import __version__

    return {"fedsim": __version__, "flwr": flwr.__version__, "torch": torch.__version__, "python": platform.python_version()}


def central_privacy(rounds: list[dict]) -> dict | None:
    """The ε a differentially private defense (dp_fedavg) reported in the last round it accounted
    for, or None when none ran. `epsilon` null means infinite (no noise)."""
    for r in reversed(rounds):
        for name, info in (r.get("defenses") or {}).items():
            if isinstance(info, dict) and "epsilon" in info and "accountant" in info:
                return {"epsilon": info["epsilon"], "delta": info["delta"], "accountant": info["accountant"],
                        "rounds": info["rounds"], "defense": name}
    return None


def local_privacy(scenario, rounds: list[dict]) -> dict | None:
    """The per-client ε of local DP (federation.local_dp) after the rounds' releases: that of the
    client sampled most often, which bounds every client's; None without local DP."""
    settings = scenario.federation.local_dp
    if settings is None:
        return None
    ledger = LocalPrivacyLedger(settings, scenario.federation.num_clients)
    for r in rounds:
        if r["round"] > 0:
            ledger.count(r.get("sampled", []))
    return ledger.report()


def federation_time(scenario, rounds: list[dict]) -> dict | None:
    """On the federation clock (`systems:`): the simulated time the run took and, for each of
    `systems.targets`, the simulated time and round at which the main accuracy first reached it
    (null: never, among the evaluated rounds)."""
    timed = [r for r in rounds if r.get("sim_time") is not None]
    if scenario.systems is None or not timed:
        return None
    reached = {}
    for target in scenario.systems.targets:
        first = next((r for r in timed if (r.get("main_accuracy") or 0.0) >= target), None)
        reached[f"{target:g}"] = None if first is None else {"sim_time": first["sim_time"], "round": first["round"]}
    stragglers = sum(len(r.get("stragglers", [])) for r in timed)
    dropped = sum(len(r.get("dropped_out", [])) for r in timed)
    return {"sim_time": timed[-1]["sim_time"], "time_to_accuracy": reached, "stragglers": stragglers, "dropped_out": dropped}


def edge_summary(scenario, rounds: list[dict]) -> dict | None:
    """With evaluation.edge_model: per copy, the final and best main accuracy, the final and peak
    backdoor success, the last agreement with the fp32 model, and `gap`: the four figures on the copy
    minus the same on the fp32 model (training rounds only; a backdoor figure is null without an
    attack); an int8 copy also names torch's quantized engine, whose kernels gave its numbers.
    None without edge copies."""
    import torch

    lines = [r for r in rounds if r["round"] > 0 and r.get("edge_model")]
    if not lines:
        return None

    def figures(get):
        acc = [v for r in lines if (v := get(r, "main_accuracy")) is not None]
        bd = [v for r in lines if (v := get(r, "backdoor_success")) is not None]
        return {"final_main_accuracy": acc[-1] if acc else None, "best_main_accuracy": max(acc, default=None),
                "final_backdoor_success": bd[-1] if bd else None, "peak_backdoor_success": max(bd, default=None)}

    fp32 = figures(lambda r, key: r.get(key))
    int8 = {c.key() for c in scenario.evaluation.edge_model if c.quantize == "int8"}
    out = {}
    for name in lines[-1]["edge_model"]:
        own = figures(lambda r, key: (r["edge_model"].get(name) or {}).get(key))
        own["final_agreement"] = lines[-1]["edge_model"][name].get("agreement")
        own["gap"] = {k: None if own[k] is None or fp32[k] is None else own[k] - fp32[k] for k in fp32}
        if name in int8:
            own["quantized_engine"] = torch.backends.quantized.engine
        out[name] = own
    return out


def leakage_summary(rounds: list[dict]) -> dict | None:
    """With `privacy_attacks`: per attack and target, how many uploads/aggregates/games it attacked
    and its strongest result (inversion: the highest mean PSNR of one attacked update, its SSIM and
    label accuracy, the mean PSNR over all; membership: the last round's AUC and TPR at 1% FPR and
    the highest AUC); seconds spent in all. None without privacy attacks."""
    entries = [(r, e) for r in rounds for e in (r.get("privacy_attack") or [])]
    if not entries:
        return None
    out: dict = {}
    for r, e in entries:
        key = f"{e['attack']}/{e['target']}"
        out.setdefault(key, []).append(e)
    seconds = {}  # per attack and target: the keys are attack/target/client (inversion) or attack (membership)
    for r in rounds:
        for k, v in (r.get("privacy_attack_seconds") or {}).items():
            parts = k.split("/")
            key = "/".join(parts[:2]) if len(parts) > 1 else f"{parts[0]}/model"
            seconds[key] = seconds.get(key, 0.0) + v
    summary = {}
    for key, items in out.items():
        if items[0]["target"] == "model":
            best = max(items, key=lambda e: e.get("auc") or 0.0)
            summary[key] = {"games": len(items), "final_auc": items[-1].get("auc"),
                            "final_tpr_at_1pct_fpr": items[-1].get("tpr_at_1pct_fpr"), "best_auc": best.get("auc"),
                            "best_round": best["round"]}
            continue
        scored = [e for e in items if e.get("psnr_mean") is not None]
        best = max(scored, key=lambda e: e["psnr_mean"], default=None)
        summary[key] = {"attacked": len(items),
                        "mean_psnr": sum(e["psnr_mean"] for e in scored) / len(scored) if scored else None,
                        "best_psnr": None if best is None else best["psnr_mean"],
                        "best_ssim": None if best is None else best.get("ssim_mean"),
                        "best_label_accuracy": None if best is None else best.get("label_accuracy"),
                        "best_round": None if best is None else best["round"],
                        "best_clients": None if best is None else best.get("clients")}
    for key in summary:
        summary[key]["seconds"] = seconds.get(key)
    return summary


def summarize(scenario, rounds: list[dict], extra: dict) -> dict:
    def series(key):  # training rounds only: round 0 is the initial (possibly pre-trained) model
        return [(r["round"], r[key]) for r in rounds if r.get(key) is not None and r["round"] > 0]

    acc, bd = series("main_accuracy"), series("backdoor_success")
    optional = {k: v for k, v in (("privacy", central_privacy(rounds)), ("local_privacy", local_privacy(scenario, rounds)),
                                  ("federation_time", federation_time(scenario, rounds)),
                                  ("edge_model", edge_summary(scenario, rounds)), ("leakage", leakage_summary(rounds)))
                if v is not None}  # present only with differential privacy, on the federation clock, with edge copies,
    # with privacy attacks
    return _clean(
        {
            "name": scenario.name,
            "seed": scenario.seed,
            "rounds_completed": max((r["round"] for r in rounds), default=0),
            "final_main_accuracy": acc[-1][1] if acc else None,
            "best_main_accuracy": max((v for _, v in acc), default=None),
            "final_backdoor_success": bd[-1][1] if bd else None,
            "peak_backdoor_success": max((v for _, v in bd), default=None),
            "total_bytes_up": sum(r.get("bytes_up", 0) for r in rounds),
            "total_bytes_down": sum(r.get("bytes_down", 0) for r in rounds),
            "wall_seconds": sum(r.get("wall_seconds", 0.0) for r in rounds),
            "rounds_skipped": [r["round"] for r in rounds if r.get("skipped")],
            "detection": run_detection(rounds),
            "backdoor_lifecycle": backdoor_lifecycle(rounds, scenario.evaluation.implant_threshold),
            **optional,
            "versions": _versions(),
            "determinism": determinism_report(scenario),  # the server's switches (docs/gpu.md)
            "scenario": scenario_dict(scenario),
            **extra,
        }
    )


def write_summary(run_dir: Path | RunFolder, summary: dict) -> None:
    write_text_atomic(RunFolder.of(run_dir).summary_file, json.dumps(summary, indent=2) + "\n")
