"""The loss-parity benchmark with our Mamba2 layer's forward replaced by one precision variant of
``scripts/probes/mamba2_same_weights.py`` (skip32, v32, peerlike): does the variant learn like the peer?

    python scripts/probes/parity_variant.py VARIANT <python -m hybridlm.bench.loss_parity arguments>
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mamba2_same_weights import VARIANTS, variant_forward  # noqa: E402

from hybridlm.bench import loss_parity  # noqa: E402
from hybridlm.model.layers import mamba2  # noqa: E402

if __name__ == "__main__":
    name = sys.argv[1]
    if VARIANTS.get(name) is None:
        raise SystemExit(f"variant {name!r}: expected one of skip32, v32, peerlike")
    mamba2.Mamba2.forward = variant_forward(*VARIANTS[name])
    print(f"our Mamba2 forward: precision variant {name}", flush=True)
    loss_parity.main(sys.argv[2:])
