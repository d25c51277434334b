"""The pipelines file: what it may declare, how it is read, what is checked before any work.

`schema` holds the pydantic models and `bounds` their limits: they only describe. `loader` reads
the YAML (through tasks.yaml_source), reports every problem at its line and runs the checks that
span keys; `preflight` looks at what lies outside the file (data, the model's config, the
environment). Imports go one way: loader -> preflight -> schema -> bounds, and the schema's
target union comes from the backend registry (tasks.backends.table). `tasks.spec` gathers the
public names for the rest of smelter. Nothing here imports a stage, a backend's runtime or `flows`.
"""
