"""The producing stages, one module each (export, validate, precision, build, accuracy,
benchmark), and what only they use: the source model (models), real-text feeds (inputs), calibration
feeds, int8's accuracy-aware fallback and Q/DQ lint, the three-way check of an engine (three_way), the
last look at an engine before it is registered (engine_check), and the champion's engine timed beside
the candidates (champion). A stage may import runtime/, measure/, config/, backends/, registry/ and the
shared records tasks.outcome and tasks.metrics; never judge/: a stage produces, it does not decide.
"""
