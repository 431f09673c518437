"""A 100 MB training log imported end to end (issue 25): wall and CPU seconds, peak Python allocations and the
process's peak RSS, against the file size. Memory must stay bounded (the parsers keep a few numbers per logged step,
thinned past log_series.MAX_RECORDS per rank), whatever the log's length.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/import_log_scale.py [--mb 100] [--keep] [--rank-prefixes 300000]

It writes torchtitan metrics lines at log_freq 1 (tests/helpers/import_logs.py formats) into a temp folder, then runs
`import_run` for tests/fixtures/imports/torchtitan_llama3_8b.toml into a scratch SQLite store. With --rank-prefixes N
each line carries its own `[rankN]:` prefix, N of them (issue 31: 300k prefixes for an 8-GPU config took 3.2 GiB):
the import must be refused at the first rank outside the config's GPUs, in the time and memory of a few lines.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import import_logs as logs  # noqa: E402


def write_log(path: Path, size_bytes: int, rank_prefixes: int = 0) -> int:
    head = "\n".join(logs.torchtitan_log(1)[:-2]) + "\n"
    template = (logs.titan_prefix(30) + logs.titan_metrics(0, 3.21, 1.1, 63.21, 79.11, 5800, 300.1, 30.2)
                ).replace("step:  0", "step: {}")
    with path.open("w") as f:
        f.write(head)
        step, size = 2, len(head)
        while size < size_bytes:
            chunk = "".join((f"[rank{s % rank_prefixes}]:" if rank_prefixes else "") + template.format(s) + "\n"
                            for s in range(step, step + 10_000))
            f.write(chunk)
            size += len(chunk)
            step += 10_000
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    ap.add_argument("--rank-prefixes", type=int, default=0, metavar="N", help="prefix line k with [rank k % N]:")
    args = ap.parse_args()
    from backend.importers.log_series import LogImportError
    from backend.importers.runs import import_run
    from db import queries as q
    from db.session import open_db

    folder = Path(tempfile.mkdtemp(prefix="shardlab-import-scale-"))
    log = folder / "train.log"
    steps = write_log(log, int(args.mb * 1e6), args.rank_prefixes)
    engine = open_db(f"sqlite:///{folder / 'store.db'}")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        eid = import_run(engine, config=ROOT / "tests/fixtures/imports/torchtitan_llama3_8b.toml", log=log, gpus=8)
    except LogImportError as e:
        eid, refused = None, str(e)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if eid is None:
        print(f"log {log.stat().st_size / 1e6:.1f} MB with {args.rank_prefixes:,} rank prefixes: refused in {wall:.2f} "
              f"s wall, peak Python allocations {peak / 2**20:.2f} MiB, process peak RSS {rss / 2**20:.0f} MiB (before "
              f"{rss0 / 2**20:.0f} MiB): {refused}")
        if not args.keep:
            log.unlink()
        return 0
    res = q.get_experiment(engine, eid)["result"]
    size = log.stat().st_size
    print(f"log {size / 1e6:.1f} MB, {steps - 2:,} metrics lines: imported as run {eid} in {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU (tracemalloc on)")
    print(f"peak Python allocations {peak / 2**20:.1f} MiB ({peak / size:.1%} of the file); process peak RSS "
          f"{rss / 2**20:.0f} MiB (before the import {rss0 / 2**20:.0f} MiB)")
    print(f"records used {res.imported.records_used:,} of {res.imported.records_total:,}; median step "
          f"{res.step_s_median:.4f} s; notes: {[n for n in res.notes if 'long log' in n]}")
    if not args.keep:
        log.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
