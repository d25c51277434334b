"""The pipelines file: the bounds its schema is built from and the loader that reads it.

`tasks.spec` (the pydantic models) only describes; `tasks.config.loader` reads YAML, reports
located errors and runs the checks that span keys; `tasks.preflight` looks at the environment.
Modules here import the schema and the backend registry, never a stage, a backend's runtime or
`flows`.
"""
