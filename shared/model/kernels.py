"""`python -m shared.model.kernels` (make setup): build the C++ kernels now rather than at a service's start."""

from __future__ import annotations

import logging

from shared.model import bf16_tiles, cpu_attention


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lib = cpu_attention.load_kernel()
    print(f"cpu attention kernel: {lib._name if lib is not None else 'not built; auto runs the torch backend'}")
    tiles = bf16_tiles.load_kernel()
    print(f"bf16 product kernel: {tiles._name if tiles is not None else 'not built; bf16 products run in oneDNN'}")


if __name__ == "__main__":
    main()
