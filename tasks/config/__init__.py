"""The pipelines file: what it may declare, how it is read, what is checked before any work.

`schema` holds the pydantic models and `bounds` their limits: they only describe. `loader` reads
the YAML (through tasks.config.yaml_source), reports every problem at its line and runs the checks that
span keys; `preflight` looks at what lies outside the file (data, the model's config, the
environment). Imports go one way: loader -> preflight -> schema -> bounds, and the schema's
target union comes from the backend registry (tasks.backends.table). `tasks.config.spec` gathers the
public names for the rest of smelter. `stage_settings` (the producing stages) and `settings` (the judging
steps, the registry, a candidate's MLflow run) build from a spec the part of it each step reads, so the
rest of smelter takes those, not the whole spec.

It may import runtime/, measure/ (the contended share, the capacity model), backends/ (the target union)
and tasks.metrics (the names a gate may name); never stages/, judge/, registry/ or flows/: reading a
pipelines file runs none of them.
"""
