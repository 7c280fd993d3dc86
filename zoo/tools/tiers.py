"""Tier comparisons: the papers' relative claims checked on runs trained here under one budget.

A tier (``zoo/tools/tiers.toml``) names roles (``alstm``, ``lstm``, ...), each a list of recipes: a single model or
a short sweep. Each role is represented by its sweep point with the best *validation* metric (the test split
never selects anything); the claims are then computed from the runs' ``eval.json`` and ``log.jsonl``, and
written to ``model_cards/tiers/<tier>.json`` (numbers) and ``.md`` (the README's table), with a curve figure
``model_cards/<tier>-tier-curve.png``. Roles whose runs are missing or unfinished are reported as such, and
a claim that cannot be computed yet says so instead of guessing.

A tier's ``seeds`` table lists more seeds of a sweep point (its recipe with only ``seed`` changed). A
``test_improvement`` claim with ``seeds_below`` is decided on one seed only when the gap is at least that large;
a smaller gap is within what a second seed can move, so the claim waits for every listed seed of both chosen runs
and is then decided on the means (each seed and the spread are reported).

    python -m zoo.tools.tiers ptb-5m                 # reads runs/<recipe>/ (else the bundled copies of its log and
                                               # eval.json in model_cards/), writes model_cards/tiers/ptb-5m.*
                                               # and records finished unbundled runs in model_cards/runs/
    python -m zoo.tools.tiers ptb-5m --runs-dir /elsewhere/runs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path
from typing import Any

from zoo.files import write_atomic
from zoo.tools import REPO
from zoo.tools.release.cards import has_numbers, primary_metric, release_metrics, short_device

TIERS_FILE = Path(__file__).resolve().parent / "tiers.toml"


def load_tiers(path: Path = TIERS_FILE) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def get_tier(name: str, tiers: dict[str, Any] | None = None) -> dict[str, Any]:
    """One tier's table (``tiers`` defaults to zoo/tools/tiers.toml); KeyError naming the known tiers."""
    tiers = load_tiers() if tiers is None else tiers
    if name not in tiers:
        raise KeyError(f"unknown tier {name!r} (known: {', '.join(sorted(tiers))})")
    return tiers[name]


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``log.jsonl``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stopped_by_budget(log: list[dict[str, Any]]) -> bool:
    """Whether the run's wall-clock budget (``max_minutes``) ended it: ``zoo train`` logs a ``budget_stop``."""
    return any(r.get("event") == "budget_stop" for r in log)


def _epoch_metric(rec: dict[str, Any], metric: str) -> float:
    """A log record's validation metric: perplexity, or bits per character for character-level data."""
    return rec["valid_ppl"] if metric == "perplexity" else rec["valid_loss"] / math.log(2)


def run_files(name: str, runs_dir: Path, cards_dir: Path) -> tuple[Path, Path]:
    """``(log.jsonl, eval.json)`` of a run: the copies kept in the repository (``model_cards/NAME.*`` beside a
    bundled card, else ``model_cards/runs/NAME.*``, the record of a run that was not bundled), unless the run dir
    on this machine holds a different log (a run still training, or continued since it was recorded): so a
    report names files every clone has, and counts every trained run, on any clone."""
    live = runs_dir / name / "log.jsonl"
    for folder in (cards_dir, cards_dir / "runs"):
        kept = folder / f"{name}.log.jsonl"
        if kept.is_file():
            if live.is_file() and live.read_bytes() != kept.read_bytes():
                break
            return kept, folder / f"{name}.eval.json"
    if live.is_file():
        return live, live.parent / "eval.json"
    return cards_dir / f"{name}.log.jsonl", cards_dir / f"{name}.eval.json"


def record_runs(tier_name: str, runs_dir: Path, tiers: dict[str, Any] | None = None,
                cards_dir: Path = REPO / "model_cards") -> list[Path]:
    """Copy the log and eval.json of every finished run of the tier that is not bundled into
    ``model_cards/runs/`` (the record the README's "trained here, not bundled" table and fresh clones read);
    a run stopped by its time budget keeps its log. Returns the files written (unchanged copies are not)."""
    written = []
    tier = get_tier(tier_name, tiers)
    for name in [n for names in [*tier["roles"].values(), *tier.get("seeds", {}).values()] for n in names]:
        run = runs_dir / name
        if (cards_dir / f"{name}.log.jsonl").is_file() or not (run / "log.jsonl").is_file():
            continue  # bundled (its card keeps the copies), or never trained here
        if not (run / "eval.json").is_file() and not stopped_by_budget(read_log(run / "log.jsonl")):
            continue  # still training: recorded when it finishes
        for src in ("log.jsonl", "eval.json"):
            dst = cards_dir / "runs" / f"{name}.{src}"
            if (run / src).is_file() and (not dst.is_file() or dst.read_bytes() != (run / src).read_bytes()):
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes((run / src).read_bytes())
                written.append(dst)
    return written


def read_run(name: str, runs_dir: Path, cards_dir: Path, epochs_budget: int = 0) -> dict[str, Any]:
    """What a run has written: ``status`` (missing / unfinished / finished / stopped early / sweep prefix), its
    epochs and, when it has an eval.json, metrics. A run evaluated before the tier's ``epochs_budget`` is not
    comparable, so never chosen for its role: "stopped early" when its wall-clock budget ended it, "sweep prefix"
    when it was trained short on purpose (``zoo train NAME --epochs N``: the first N epochs of the full schedule),
    which ``compare`` sets against the chosen run at the same epoch."""
    log_path, ev_path = run_files(name, runs_dir, cards_dir)
    if not log_path.is_file():
        return {"run": name, "status": "missing"}
    log = read_log(log_path)
    epochs = [r for r in log if "epoch" in r and "valid_ppl" in r]
    shown = log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path
    stopped = stopped_by_budget(log)
    out: dict[str, Any] = {"run": name, "status": "stopped early" if stopped else "unfinished", "epochs": epochs,
                           "log": shown.as_posix()}
    if ev_path.is_file():
        from zoo.tools.release.bundle import find_reference  # (zoo.tools.release.bundle reads the tier reports)

        ev = json.loads(ev_path.read_text())
        out.update(status="finished", metrics=release_metrics(ev), num_parameters=ev["num_parameters"],
                   architecture=ev["architecture"], train_seconds=ev["train_seconds"],
                   epochs_trained=ev["epochs_trained"], dataset=ev["dataset"],
                   device=short_device(ev.get("device", "")),
                   reference=find_reference(ev) if "recipe" in ev else None,
                   test_tokens=ev["test"].get("num_tokens"))
        if epochs_budget and ev["epochs_trained"] < epochs_budget:  # a time budget ended it, or it was trained
            out["status"] = "stopped early" if stopped else "sweep prefix"  # as a short sweep point on purpose
    return out


def pick_role(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished sweep point with the lowest validation metric (None if none has finished)."""
    done = [r for r in runs if r["status"] == "finished"]
    return min(done, key=lambda r: r["metrics"]["valid"]) if done else None


def _first_epoch(values: list[float], threshold: float) -> int | None:
    return next((i + 1 for i, v in enumerate(values) if v <= threshold), None)


def check_claim(claim: dict[str, Any], chosen: dict[str, dict[str, Any] | None], metric: str) -> dict[str, Any]:
    """Compute one claim from the chosen runs; ``met`` is None when a run it needs has not finished."""
    kind = claim["kind"]
    model = chosen.get(claim["model"])
    base = chosen.get(claim["baseline"]) if kind != "test_target" else model  # a target has no baseline
    res: dict[str, Any] = {k: claim[k] for k in ("kind", "model", "baseline", "source") if k in claim}
    if model is None or base is None:
        res.update(met=None, detail="not computed: a run it needs has not finished")
        return res
    res.update(model_run=model["run"])
    if kind != "test_target":
        res.update(baseline_run=base["run"])

    def num(v: float) -> str:   # bpc to the papers' 3 decimals; perplexity to 2, as the tables (77.40, not 77.4)
        return f"{v:.3f}" if metric == "bits_per_char" else f"{v:.2f}"

    if kind == "test_target":
        test = model["metrics"]["test"]
        res.update(target_max=claim["max"], measured=test, met=test <= claim["max"],
                   detail=f"test {metric}: {num(test)} (target: at most {num(claim['max'])})")
    elif kind == "test_improvement":
        rel = 1 - model["metrics"]["test"] / base["metrics"]["test"]
        target = f"target: at least {100 * claim['min_rel']:.1f}% lower"
        res.update(target_min_rel=claim["min_rel"], measured_rel=rel, met=rel >= claim["min_rel"],
                   detail=f"test {metric}: {num(model['metrics']['test'])} vs {num(base['metrics']['test'])} "
                          f"({abs(100 * rel):.1f}% {'lower' if rel >= 0 else 'higher'}; {target})")
        if abs(rel) < claim.get("seeds_below", 0.0):
            res.update(_seeded_improvement(claim, model, base, rel, num, metric, target))
        elif "seeds_below" in claim:  # say that the rule was applied: one seed decides a gap this large
            res["detail"] += f"; one seed decides: the gap is not under {100 * claim['seeds_below']:.0f}%"
    elif kind == "epochs_to_baseline_best":
        base_vals = [_epoch_metric(r, metric) for r in base["epochs"]]
        best = min(base_vals)
        base_epoch = base_vals.index(best) + 1
        reached = _first_epoch([_epoch_metric(r, metric) for r in model["epochs"]], best)
        ratio = reached / base_epoch if reached else None
        res.update(baseline_best_valid=best, baseline_best_epoch=base_epoch, model_epoch_reached=reached,
                   target_max_ratio=claim["max_ratio"], measured_ratio=ratio,
                   met=ratio is not None and ratio <= claim["max_ratio"],
                   detail=(f"baseline best valid {num(best)} at epoch {base_epoch}; model reached it at epoch "
                           f"{reached} ({ratio:.3g}x; target <= {claim['max_ratio']}x)" if reached else
                           f"baseline best valid {num(best)} at epoch {base_epoch}; model never reached it"))
    elif kind == "epochs_to_baseline_train":
        final = base["epochs"][-1]["train_loss"]
        n_base = len(base["epochs"])
        reached = _first_epoch([r["train_loss"] for r in model["epochs"]], final)
        res.update(baseline_final_train_loss=final, baseline_epochs=n_base, model_epoch_reached=reached,
                   met=reached is not None and reached < n_base,
                   detail=(f"baseline final train loss {final:.4f} after {n_base} epochs; model reached it at "
                           f"epoch {reached}" if reached else
                           f"baseline final train loss {final:.4f} after {n_base} epochs; model never reached it"))
    else:
        raise ValueError(f"unknown claim kind {kind!r}")
    return res


def _seeded_improvement(claim: dict[str, Any], model: dict[str, Any], base: dict[str, Any], rel: float,
                        num: Any, metric: str, target: str) -> dict[str, Any]:
    """A ``test_improvement`` whose one-seed gap is under ``seeds_below``: pending until every listed seed of both
    chosen runs has finished, then decided on the mean test metric over the seeds."""
    gap = f"one-seed gap {abs(100 * rel):.1f}% is under {100 * claim['seeds_below']:.0f}%"
    missing = [r["run"] for r in (model, base) if not r.get("seeds")]
    if missing:
        return {"met": None, "detail": f"pending: {gap}; list more seeds of {' and '.join(missing)} in the tier's "
                                       f"seeds table and train them"}
    todo = [s["run"] for r in (model, base) for s in r["seeds"]["runs"] if s["status"] != "finished"]
    if todo:
        return {"met": None, "detail": f"pending: {gap}; train the other seeds ({', '.join(todo)})"}
    m, b = model["seeds"], base["seeds"]
    mean_rel = 1 - m["mean_test"] / b["mean_test"]

    def show(s: dict[str, Any]) -> str:
        return (f"{num(s['mean_test'])} (seeds: {', '.join(num(t) for t in s['test'])}; "
                f"spread {num(s['max_test'] - s['min_test'])})")

    return {"measured_rel": mean_rel, "one_seed_rel": rel, "met": mean_rel >= claim["min_rel"],
            "detail": f"mean test {metric} over {len(m['test'])} and {len(b['test'])} seeds ({gap}): {show(m)} vs "
                      f"{show(b)} ({abs(100 * mean_rel):.1f}% {'lower' if mean_rel >= 0 else 'higher'}; {target})"}


def _seed_summary(chosen: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The chosen run with its other seeds: each run's status, and over the finished ones the test and
    validation metrics, their mean and range."""
    done = [chosen, *(r for r in others if r["status"] == "finished")]
    test = [r["metrics"]["test"] for r in done]
    valid = [r["metrics"]["valid"] for r in done]
    return {"runs": [{"run": r["run"], "status": r["status"],
                      **({"test": r["metrics"]["test"], "valid": r["metrics"]["valid"]} if "metrics" in r else {})}
                     for r in others],
            "test": test, "valid": valid, "mean_test": sum(test) / len(test), "min_test": min(test),
            "max_test": max(test), "mean_valid": sum(valid) / len(valid)}


def compare(tier_name: str, runs_dir: Path, tiers: dict[str, Any] | None = None,
            cards_dir: Path = REPO / "model_cards") -> dict[str, Any]:
    """The tier's report: every sweep point, the chosen run per role, the parameter budget and the claims."""
    tier = get_tier(tier_name, tiers)
    metric = primary_metric(tier["dataset"])
    roles: dict[str, Any] = {}
    chosen: dict[str, dict[str, Any] | None] = {}
    undecided: dict[str, str] = {}  # role -> why its choice is not final yet
    for role, recipes in tier["roles"].items():
        runs = [read_run(name, runs_dir, cards_dir, tier.get("epochs", 0)) for name in recipes]
        for r in runs:  # an unfinished run shows where it stands (or that it diverged)
            if r["status"] in ("unfinished", "stopped early") and r["epochs"]:
                r["last_valid"] = _epoch_metric(r["epochs"][-1], metric)
        chosen[role] = pick_role(runs)
        seed_runs = tier.get("seeds", {}).get(chosen[role]["run"], []) if chosen[role] else []
        if seed_runs:
            chosen[role] = chosen[role] | {"seeds": _seed_summary(chosen[role], [
                read_run(name, runs_dir, cards_dir, tier.get("epochs", 0)) for name in seed_runs])}
        for r in runs:
            if r["status"] == "sweep prefix" and chosen[role] and r["epochs"]:
                r["prefix"] = _prefix_check(r, chosen[role], metric)
                if r["prefix"]["beats_chosen"]:
                    undecided[role] = (f"pending: sweep prefix {r['run']} beats {chosen[role]['run']} on validation "
                                       f"at epoch {r['prefix']['epoch']}; train it to the full budget "
                                       f"(zoo train {r['run']} --epochs {tier.get('epochs')} --resume)")
        waiting = [r["run"] for r in runs if r["status"] in ("unfinished", "missing")]
        if waiting and chosen[role] and role not in undecided:  # it could still be the better point
            undecided[role] = f"pending: {', '.join(waiting)} not trained to its end yet"
        roles[role] = {"chosen": chosen[role]["run"] if chosen[role] else None,
                       **({"seeds": chosen[role]["seeds"]} if chosen[role] and "seeds" in chosen[role] else {}),
                       "sweep": [{k: v for k, v in r.items() if k != "epochs"} | {"epochs_logged": len(r.get(
                           "epochs", []))} for r in runs]}
    params = [c["num_parameters"] for c in chosen.values() if c]
    budget = {"min": min(params), "max": max(params), "spread": max(params) / min(params) - 1,
              "tolerance": tier["param_tolerance"]} if params else None
    if budget:
        # "within 5% of each other": the largest at most 5% above the smallest (so every pair within 5%)
        budget["met"] = budget["spread"] <= budget["tolerance"] + 1e-12
    return {"tier": tier_name, "title": tier["title"], "dataset": tier["dataset"], "metric": metric,
            "curve": tier.get("curve", "time"), "note": tier.get("note"),
            "roles": roles,
            "param_budget": budget, "claims": [_pending(c, undecided) or check_claim(c, chosen, metric)
                                                for c in tier.get("claims", [])]}


def _prefix_check(prefix: dict[str, Any], chosen: dict[str, Any], metric: str) -> dict[str, Any]:
    """A sweep prefix against its role's chosen run at the prefix's last epoch (both on validation): the two share
    the schedule's first epochs, so if the prefix is ahead there, the choice is not made yet."""
    n = len(prefix["epochs"])
    mine = _epoch_metric(prefix["epochs"][-1], metric)
    theirs = _epoch_metric(chosen["epochs"][n - 1], metric) if len(chosen["epochs"]) >= n else None
    return {"epoch": n, "valid": mine, "chosen_run": chosen["run"], "chosen_valid": theirs,
            "beats_chosen": theirs is not None and mine < theirs}


def _pending(claim: dict[str, Any], undecided: dict[str, str]) -> dict[str, Any] | None:
    """A claim whose role choice is not final is pending, whatever the runs chosen so far would say."""
    why = next((undecided[r] for r in (claim["model"], claim.get("baseline")) if r in undecided), None)
    if why is None:
        return None
    return {k: claim[k] for k in ("kind", "model", "baseline", "source") if k in claim} | {"met": None,
                                                                                           "detail": why}


def markdown(report: dict[str, Any]) -> str:
    """The table the README shows: one row per sweep point (chosen ones in bold), then the claims."""
    digits = 3 if report["metric"] == "bits_per_char" else 2
    lines = [f"**{report['title']}** (metric: {report['metric']}; each role's sweep point chosen on validation)",
             "", "| role | run | status | params | epochs | valid | test | trained on |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for role, info in report["roles"].items():
        for r in info["sweep"]:
            name = f"**{r['run']}**" if r["run"] == info["chosen"] else r["run"]
            m = r.get("metrics")
            cells = ([f"{r['num_parameters'] / 1e6:.2f}M", str(r["epochs_trained"]), f"{m['valid']:.{digits}f}",
                      f"{m['test']:.{digits}f}", r["device"]] if m else
                     ["", str(r["epochs_logged"] or ""),
                      f"({r['last_valid']:.{digits}f} at its last epoch)" if "last_valid" in r else "", "", ""])
            status = "no finished run in the repository yet" if r["status"] == "missing" else r["status"]
            if "prefix" in r and r["prefix"]["chosen_valid"] is not None:
                px = r["prefix"]
                status += (f" (epoch {px['epoch']}: {px['valid']:.{digits}f} vs {px['chosen_valid']:.{digits}f} "
                           f"for {px['chosen_run']})")
            lines.append(f"| {role} | {name} | {status} | " + " | ".join(cells) + " |")
        for r in info.get("seeds", {}).get("runs", []):
            cells = ["", "", f"{r['valid']:.{digits}f}", f"{r['test']:.{digits}f}", ""] if "test" in r else [""] * 5
            status = "no finished run in the repository yet" if r["status"] == "missing" else r["status"]
            lines.append(f"| {role} | {r['run']} | other seed of {info['chosen']}: {status} | " + " | ".join(cells)
                         + " |")
    b = report["param_budget"]
    if b:
        lines += ["", f"Parameter budget of the chosen runs: {b['min']:,} to {b['max']:,} "
                      f"(the largest {100 * b['spread']:.1f}% above the smallest; "
                      f"{'within' if b['met'] else 'OUTSIDE'} the tier's {100 * b['tolerance']:.0f}%)."]
    if report.get("note"):
        counts = {r.get("test_tokens") for info in report["roles"].values() for r in info["sweep"]
                  if r["run"] == info["chosen"]} - {None}
        scored = f" Test symbols scored: {counts.pop():,} (from each run's eval.json)." if len(counts) == 1 else ""
        lines += ["", report["note"] + scored]
    lines += ["", "| claim | result | runs compared | measured |", "|---|---|---|---|"]
    for c in report["claims"]:
        verdict = {True: "met", False: "**not met**", None: "pending"}[c["met"]]
        runs = " vs ".join(c[k] for k in ("model_run", "baseline_run") if k in c)  # which sweep points decided
        lines.append(f"| {c['source']} | {verdict} | {runs} | {c['detail']} |")
    lines += published_table(report, digits)
    return "\n".join(lines) + "\n"


def published_table(report: dict[str, Any], digits: int) -> list[str]:
    """Where each chosen run lands against the published number its recipe cites (``[reference]``): the
    papers' models are usually larger and trained far longer, so this is a distance, not a claim."""
    rows = []
    for role, info in report["roles"].items():
        run = next((r for r in info["sweep"] if r["run"] == info["chosen"]), None)
        if run is None:
            continue
        ref = run.get("reference") or {}
        if ref.get("source") and not has_numbers(ref):  # cites a setting, no number
            rows.append(f"| {role} | {run['run']} | {run['metrics']['test']:.{digits}f} | no comparable number |  | "
                        f"{ref['source']} |")
            continue
        if ref.get("test") is None or ref.get("metric", report["metric"]) != report["metric"]:
            rows.append(f"| {role} | {run['run']} | {run['metrics']['test']:.{digits}f} | not published |  |  |")
            continue
        gap = run["metrics"]["test"] - ref["test"]
        rows.append(f"| {role} | {run['run']} | {run['metrics']['test']:.{digits}f} | {ref['test']:.{digits}f} | "
                    f"{gap:+.{digits}f} ({100 * gap / ref['test']:+.1f}%) | {ref.get('source', '')} |")
    if not rows:
        return []
    return ["", f"Against the published numbers (test {report['metric']}; the published models' size and "
                "training budget are in the last column):", "",
            "| role | run | test here | published | difference | published model |",
            "|---|---|---:|---:|---:|---|", *rows]


def write(report: dict[str, Any], out_dir: Path, figure_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = report["tier"]
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    write_atomic(paths[0], json.dumps(report, indent=2) + "\n")
    write_atomic(paths[1], markdown(report))
    shown = [r for info in report["roles"].values() for r in info["sweep"] if r["status"] != "missing"]
    if shown:
        from zoo.tools.plots import plot_curves

        metric = "valid_ppl" if report["metric"] == "perplexity" else "valid_bpc"
        labels = [r["run"] + (f" ({r['device']})" if r.get("device") else "") for r in shown]
        paths.append(plot_curves([REPO / r["log"] for r in shown], figure_dir / f"{name}-tier-curve.png",
                                 report["title"], metric=metric, labels=labels, layout=report.get("curve", "time")))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tier", nargs="+", help="tier name(s) from zoo/tools/tiers.toml")
    ap.add_argument("--runs-dir", default=str(REPO / "runs"))
    ap.add_argument("--out-dir", default=str(REPO / "model_cards" / "tiers"))
    ap.add_argument("--figure-dir", default=str(REPO / "model_cards"))
    ap.add_argument("--cards-dir", default=str(REPO / "model_cards"),
                    help="where bundled runs keep their log/eval copies and unbundled ones their records (runs/)")
    ap.add_argument("--no-record", action="store_true",
                    help="do not copy finished, unbundled runs into CARDS_DIR/runs/ before the report")
    args = ap.parse_args(argv)
    cards_dir = Path(args.cards_dir)
    for tier in args.tier:
        try:
            recorded = [] if args.no_record else record_runs(tier, Path(args.runs_dir), cards_dir=cards_dir)
            report = compare(tier, Path(args.runs_dir), cards_dir=cards_dir)
        except KeyError as e:
            print(f"error: {e.args[0]}", file=sys.stderr)
            return 2
        for p in [*recorded, *write(report, Path(args.out_dir), Path(args.figure_dir))]:
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
