"""Everything smelter records in MLflow, and the only code that imports mlflow (with tasks/mlflow_webhooks.py's
client calls in `webhooks`): metric, tag and artifact names are decided here, in one place, and stay the same
every run (the MLflow compare view lines up only when names never drift).

One concern per module, each importing only the ones before it:
client (the store, `_client`), versions (registered models, versions, aliases, version and measurement tags,
engine identity), runs (experiments, parent and child runs, tags, params, metrics, stale runs, UI links),
uploads (engine files, dedup, signature), card (the engine card), candidates (a candidate's run: logged,
judged, read back), webhooks (MLflow's registry webhooks).

May import: mlflow and tasks' lower floors (spec, store, outcome, metrics, holder, locks, killpoints,
engine_check, redact, yaml_source); never flows/ nor the stages that record through it (promote, notify,
...). Everyone else goes through tasks/tracking.py; a leading underscore means package-internal.
"""
