"""Alembic migrations: a database made by the first revision upgrades with its rows intact, and the
models never drift from the migrations."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from db import queries as q
from db.migrations import current_revision, head_revision, upgrade
from db.models import Base
from db.session import get_engine, init_db


def test_first_revision_database_upgrades_and_keeps_its_rows(store_urls):
    url = store_urls.url("old.db", blank=True)
    engine = get_engine(url)
    upgrade(engine, "0001")
    assert current_revision(engine) == "0001"
    with engine.begin() as c:
        c.execute(text(
            "INSERT INTO experiments (name, spec_json, strategy, world_size, dp, tp, pp, ep, zero_stage, schedule, "
            "microbatches, virtual_stages, sequence_parallel, d_model, n_layers, n_heads, n_kv_heads, ffn, seq_len, "
            "vocab, n_experts, top_k, global_batch, micro_batch, steps, precision, optimizer, recompute, status, "
            "cancel_requested, created_at, step_s_median) VALUES ('old run', :spec, 'ddp', 2, 2, 1, 1, 1, 0, '1f1b', "
            "2, 1, :no, 32, 2, 2, 2, 128, 16, 64, 0, 2, 4, 2, 2, 'fp32', 'adamw', 'none', 'ok', :no, "
            "'2026-01-02 03:04:05.000000', 0.5)"),
            {"spec": '{"name": "old run", "parallel": {"world_size": 2}}', "no": False})
        c.execute(text("INSERT INTO experiment_tags (experiment_id, tag) VALUES (1, 'kept')"))
    init_db(engine)
    assert current_revision(engine) == head_revision() != "0001"
    (row,) = q.list_experiments(engine)
    assert (row["id"], row["name"], row["status"], row["step_s_median"],
            row["tags"]) == (1, "old run", "ok", 0.5, ["kept"])
    assert row["requeue_of"] is None and row["created_at"].year == 2026
    assert q.get_experiment(engine, 1)["spec"].parallel.world_size == 2
    assert q.worker_heartbeats(engine) == []  # the table added by a later revision exists


def test_models_match_the_migrated_schema(store_urls):
    engine = init_db(get_engine(store_urls.url("new.db", blank=True)))
    with engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata)
    assert diff == [], "models changed without an Alembic revision: " + repr(diff)


def test_backfill_of_export_summaries_matches_what_new_results_store(store_urls):
    from alembic import command
    from sqlalchemy import select

    from db.migrations import alembic_config
    from db.models import ExperimentSummary, RankResultRow
    from db.session import write_engine
    from tests.helpers.store_helpers import fake_result, spec

    engine = init_db(get_engine(store_urls.url("fill.db", blank=True)))
    stored = {}
    for i, status in enumerate(["ok", "failed"]):
        s = spec(f"r{i}", world_size=2)
        eid = q.submit_experiment(engine, s)
        q.claim_next(engine, "w")
        q.store_result(engine, eid, fake_result(s, status, seed=i))

    def snapshot():
        with engine.connect() as c:
            summaries = [dict(r._mapping)
                         for r in c.execute(select(ExperimentSummary).order_by(ExperimentSummary.experiment_id))]
            ranks = [dict(r._mapping) for r in c.execute(select(RankResultRow).order_by(RankResultRow.id))]
        return summaries, ranks

    stored = snapshot()
    assert stored[0][0]["torch_version"] == "2.13.0+cpu" and stored[0][0]["comm_all_reduce_bytes"] > 0
    cfg = alembic_config(engine)
    with write_engine(engine).begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002")
    assert current_revision(engine) == "0002"
    upgrade(engine, "head")
    again = snapshot()
    for before, after in zip(stored[0] + stored[1], again[0] + again[1], strict=False):
        assert before.keys() == after.keys()
        for k in before:
            if isinstance(before[k], float):
                assert after[k] == pytest.approx(before[k], rel=1e-12), k
            else:
                assert after[k] == before[k], k
