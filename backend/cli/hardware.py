"""`python -m backend hardware`: the hardware profiles the step-time model knows.

  python -m backend hardware            # table: key, name, peak bf16/fp32, HBM, intra/inter bandwidth
  python -m backend hardware --json     # every profile with its tunables and datasheet source

Profiles: backend/analytic/steptime/hardware.json, extended by $SHARDLAB_HARDWARE (a JSON file of the same
shape); "cpu" appears once `python -m backend.bench.hw_probe` has measured this machine. Calibrated profiles
(`python -m backend calibrate --name`), which --hardware accepts too, are listed from the store (--db) when it exists.
"""

from __future__ import annotations

import argparse
import json

from backend.analytic.steptime.hardware import Hardware, load_profiles
from backend.cli import fail


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object {key: profile}")
    p.add_argument("--db", help="database URL for calibrated profiles (default: SHARDLAB_DB_URL or data/shardlab.db)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        profiles = load_profiles()
    except ValueError as e:
        return fail(str(e))
    calibrated, problem = _calibrated(args.db)
    if args.json:
        print(json.dumps({k: v.to_dict() for k, v in {**profiles, **calibrated}.items()}))
        return 0
    head = (f"{'key':<14} {'name':<34} {'bf16 TF/s':>9} {'fp32 TF/s':>9} {'mem GiB':>7} {'HBM GB/s':>8} "
            f"{'intra GB/s':>10} {'inter GB/s':>10}")
    print(head)
    for k, h in {**profiles, **calibrated}.items():
        print(f"{k:<14} {h.name[:34]:<34} {h.peak('bf16-mixed') / 1e12:>9.1f} {h.peak('fp32') / 1e12:>9.2f} "
              f"{h.memory_bytes / 2**30:>7.1f} {h.hbm_bytes_per_s / 1e9:>8.0f} {h.intra_bytes_per_s / 1e9:>10.1f} "
              f"{h.inter_bytes_per_s / 1e9:>10.1f}")
    if "cpu" not in profiles:
        print("(no 'cpu' profile yet: `python -m backend.bench.hw_probe` measures this machine)")
    for k, h in calibrated.items():
        print(f"({k}: calibration {h.calibration_id}, stored by `python -m backend calibrate --name {k}`)")
    if problem:
        print(f"(calibrated profiles not listed: {problem})")
    return 0


def _calibrated(db_url: str | None) -> tuple[dict[str, Hardware], str | None]:
    """The calibrated profiles by name, each with its fitted parameters (what --hardware NAME resolves to), and why
    none could be read; a store file that does not exist yet holds none (and is not created here)."""
    from backend.calibration.records import existing_store, named_profiles, resolve

    try:
        engine = existing_store(db_url)
        names = [c["name"] for c in named_profiles(engine)] if engine is not None else []
        return {n: resolve(n, None, db_url)[0] for n in names}, None
    except Exception as e:  # noqa: BLE001 - the shipped profiles are listed whatever the store's state
        return {}, f"{type(e).__name__}: {e}"
