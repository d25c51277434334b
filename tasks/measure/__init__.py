"""How engines are timed and what the times mean: interleaved rounds (rounds), paired-ratio
statistics and their interval (stats), how busy the host was (hostload), GPU timing and ceilings
(gpu_measure), and the capacity arithmetic on measured figures (capacity). It may import tasks/runtime/
only: a measurement knows no stage, pipelines file or registry, so benchmarks/ scripts time engines with
it exactly as the benchmark stage does.
"""
