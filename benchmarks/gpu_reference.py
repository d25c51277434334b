"""PyTorch eager on the GPU vs the CPU for a MiniLM-shaped encoder: the reference a TensorRT engine is compared with.

The benchmark stage times eager PyTorch on the GPU beside a TensorRT engine (`reference_device`).
This script runs that same timed call (`tasks.stages.benchmark.reference_call`, synchronized per call) on
each device the machine has, in one run, with random weights of all-MiniLM-L6-v2's shape (speed
does not depend on the values). Usage: python benchmarks/gpu_reference.py [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
from transformers import BertConfig, BertModel

from tasks.stages.benchmark import LatencySamples, reference_call, time_call_ms

CPU_REPEATS = 10  # eager CPU is two orders of magnitude slower than the GPU; 10 calls keep the run short

MINILM = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                    vocab_size=30522, max_position_embeddings=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=100, help=f"timed calls per GPU run; CPU runs do at most {CPU_REPEATS}")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = BertModel(MINILM).eval()
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(1000, 30000, (args.batch, args.seq), dtype=np.int64),
             "attention_mask": np.ones((args.batch, args.seq), dtype=np.int64),
             "token_type_ids": np.zeros((args.batch, args.seq), dtype=np.int64)}
    runs = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        runs += [("cuda", torch.float32), ("cuda", torch.float16)]
    print(f"MiniLM-shaped encoder, batch {args.batch} x seq {args.seq}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    for device, dtype in runs:
        weights = copy.deepcopy(model).to(device=device, dtype=dtype)
        call = reference_call(weights, feeds, "feature-extraction", device)
        repeats = args.repeats if device == "cuda" else min(args.repeats, CPU_REPEATS)
        samples = LatencySamples(time_call_ms(call, 10, repeats))
        row = samples.summary(args.batch, args.batch * args.seq)
        print(f"{device:<5} {str(dtype).removeprefix('torch.'):<8}  {repeats:4d} repeats  p50 {row['p50_ms']:8.3f} ms  "
              f"p99 {row['p99_ms']:8.3f} ms  {row['throughput']:10.1f} samples/s")


if __name__ == "__main__":
    main()
