"""The tensorrt backend: TensorRT engines on NVIDIA GPUs. `target` declares it and its settings,
`backend` is the only module that imports tensorrt, `plan` decides in plain Python what a build or load
does, and `triton_repository` lays promoted engines out as a Triton Inference Server model repository.
Like every backend it may import runtime/, measure/, config/ and the interface in tasks/backends/.
"""
