"""A GLM-style decode loop offloaded to a running worker, checked against NumPy.

    coliworker serve &            # or: python -m coliworker serve
    python examples/decode_loop.py --address 127.0.0.1:50051 --layers 3 --tokens 6

The loop (``coliworker.tools.demo``) decodes two sequences through a few layers of MLA
attention over worker-resident ragged KV caches and routed int4 MoE experts, rolls one
sequence back a token halfway, and checks every offloaded result against the float64
reference computed locally from the same inputs (exit status 1 on a mismatch).
"""

import argparse

from coliworker.tools.demo import run_demo

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    raise SystemExit(run_demo(a.address, a.layers, a.tokens, a.seed))
