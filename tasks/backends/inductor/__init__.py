"""The inductor backend: PyTorch Inductor engines built from the model itself. `target` declares it
and its settings, `backend` builds and loads them; the Llama-family graphs (llama_graphs, llama_support),
the decode step's own ops (decode_products) and their kernels shipped in the engine (kernel_bundle), one
copy of the weights for every graph (graph_weights), precompiled graphs (precompiled) and a fast program
load (program_load) serve it. Like every backend it may import runtime/, measure/, config/ and the
interface in tasks/backends/.
"""
