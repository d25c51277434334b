"""Engine backends: the interface every backend implements (base) and the registry that finds
them through the `smelter.backends` entry points (table), then one package per built-in backend
(onnxruntime/, tensorrt/, inductor/), each registered as a plugin is: `target` declares it and its
settings, `backend` builds and loads its engines. A backend may import runtime/, measure/ and config/;
never stages/, judge/ or registry/: the core calls a backend, never the reverse. Nothing outside a
backend's package imports it: the core asks what the backend declares through base (a plugin's package
is out of its reach anyway).
"""
