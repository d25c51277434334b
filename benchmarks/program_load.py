"""torch.export.load against smelter's memoised load (tasks/backends/inductor/program_load.py), side by side.

Exports a 16-layer Llama-family prefill and decode step (the inductor engine's two graphs, weights
as input; narrow layers, since load time grows with graph nodes, not weights), saves them, then
loads each both ways in interleaved rounds in this process and prints medians, ranges and the
paired ratio with its 95% interval (tasks/measure/stats.py).
Usage: python benchmarks/program_load.py [--layers 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tasks.backends.inductor.backend import export_decode, export_prefill  # noqa: E402
from tasks.backends.inductor.program_load import load_program  # noqa: E402
from tasks.measure.stats import paired_ratio  # noqa: E402


def timed(load: Callable[[Path], object], path: Path) -> float:
    started = time.perf_counter()
    load(path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ways = {"torch.export.load": lambda p: torch.export.load(str(p)), "memoised": load_program}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"prefill": Path(tmp) / "prefill.pt2", "decode": Path(tmp) / "decode.pt2"}
        torch.export.save(export_prefill(model, True, 2, 16, weights_as_input=True).program, str(paths["prefill"]))
        torch.export.save(export_decode(model, torch.float32, weights_as_input=True).program, str(paths["decode"]))
        for way in ways.values():  # first loads import and warm what later ones reuse
            way(paths["prefill"])
        print(f"{args.layers}-layer Llama graphs, {args.rounds} interleaved rounds, torch {torch.__version__}")
        for graph, path in paths.items():
            times: dict[str, list[float]] = {name: [] for name in ways}
            for round_ in range(args.rounds):
                order = list(ways.items()) if round_ % 2 == 0 else list(ways.items())[::-1]
                for name, way in order:
                    times[name].append(timed(way, path))
            for name, values in times.items():
                print(f"  {graph:<8} {name:<18} median {statistics.median(values):.3f} s, "
                      f"range {min(values):.3f}-{max(values):.3f} s")
            ratio = paired_ratio(times["torch.export.load"], times["memoised"])
            print(f"  {graph:<8} memoised is {ratio.text()} as fast (95% interval)")


if __name__ == "__main__":
    main()
