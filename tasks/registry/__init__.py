"""Everything smelter records in MLflow, and the only code that imports mlflow (with tasks/judge/mlflow_webhooks.py's
client calls in `webhooks`): metric, tag and artifact names are decided here, in one place, and stay the same
every run (the MLflow compare view lines up only when names never drift).

One concern per module, each importing only the ones before it:
client (the store, `_client`), versions (registered models, versions, aliases, version and measurement tags,
engine identity), runs (experiments, parent and child runs, tags, params, metrics, stale runs, UI links),
uploads (engine files, dedup, signature), card (the engine card), candidates (a candidate's run: logged,
judged, read back), webhooks (MLflow's registry webhooks).

May import: mlflow, runtime/, measure/, config/, stages/ (what a stage recorded: the accuracy stage's
eval text, the engine check before an upload) and the shared records tasks.outcome and tasks.metrics;
never judge/ (the steps that record through it) nor flows/. Everyone else goes through
tasks/registry/tracking.py; a leading underscore means package-internal.
"""
