"""The onnxruntime backend: ONNX Runtime on the CPU. `target` declares it and its settings (no
onnxruntime import), `backend` optimizes a graph once for this CPU and loads it without re-optimizing.
Like every backend it may import runtime/, measure/, config/ and the interface in tasks/backends/.
"""
